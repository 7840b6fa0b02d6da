"""SGLang's `sglang.lang.choices` names: select()'s choices_method values."""

from frontend_dsl.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)

__all__ = [
    "greedy_token_selection", "token_length_normalized", "unconditional_likelihood_normalized",
]
