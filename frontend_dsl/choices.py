"""select()'s decision rules over per-choice token logprobs (entries are [logprob, id, text])."""

from __future__ import annotations

from typing import Any


def _values(entries: list[list[Any]]) -> list[float]:
    return [float(e[0]) for e in entries if e[0] is not None]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def decide(
    method: str,
    choices: list[str],
    choice_logprobs: list[list[list[Any]]],
    unconditional_logprobs: list[list[list[Any]]] | None = None,
) -> tuple[str, dict[str, Any]]:
    """Pick one choice; returns (choice, meta_info with the scores used)."""
    normalized = [_mean(_values(lp)) for lp in choice_logprobs]
    meta: dict[str, Any] = {
        "normalized_prompt_logprobs": normalized,
        "input_token_logprobs": choice_logprobs,
    }
    if method == "token_length_normalized":
        best = _argmax(normalized)
    elif method == "greedy_token_selection":
        best, meta["greedy_logprob_matrix"] = _greedy(choice_logprobs)
    elif method == "unconditional_likelihood_normalized":
        if unconditional_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        pairs = zip(choice_logprobs, unconditional_logprobs, strict=True)
        scores = [_uncond_score(c, u) for c, u in pairs]
        meta["unconditional_token_logprobs"] = unconditional_logprobs
        meta["normalized_unconditional_prompt_logprobs"] = scores
        best = _argmax(scores)
    else:
        raise ValueError(f"unknown choices_method {method!r}")
    return choices[best], meta


def _greedy(choice_logprobs: list[list[list[Any]]]) -> tuple[int, list[list[float]]]:
    """Compare token by token; a shorter choice is padded with its own mean logprob."""
    rows = [[float(e[0]) if e[0] is not None else 0.0 for e in lp] for lp in choice_logprobs]
    width = max(len(r) for r in rows)
    matrix = [r + [_mean(r) if r else 0.0] * (width - len(r)) for r in rows]
    remaining = list(range(len(matrix)))
    for j in range(width):
        top = max(matrix[i][j] for i in remaining)
        remaining = [i for i in remaining if matrix[i][j] == top]
        if len(remaining) == 1:
            break
    return remaining[0], matrix


def _uncond_score(cond: list[list[Any]], uncond: list[list[Any]]) -> float:
    """Mean over the choice's tokens of log p(token | prompt) - log p(token | choice alone)."""
    a = [float(e[0]) if e[0] is not None else 0.0 for e in cond]
    b = [float(e[0]) if e[0] is not None else 0.0 for e in uncond]
    if len(b) > len(a):
        raise ValueError("more unconditional than conditional logprobs")
    # the first token has no unconditional logprob (a runtime may omit or null it): count 0
    b = [0.0] * (len(a) - len(b)) + b
    return _mean([x - y for x, y in zip(a, b, strict=False)])


def choice_token_logprobs(
    entries: list[list[Any]], choice: str, fallback_count: int
) -> list[list[Any]]:
    """The trailing entries whose token texts cover `choice` (a token may straddle the boundary).

    Without token texts, take the last `fallback_count` entries.
    """
    if not entries:
        return []
    if any(e[2] is None for e in entries):
        return entries[-fallback_count:] if fallback_count > 0 else entries[-1:]
    covered, i = 0, len(entries)
    while i > 0 and covered < len(choice):
        i -= 1
        covered += len(entries[i][2])
    return entries[i:] if i < len(entries) else entries[-1:]


# SGLang spells select's choices_method as module-level objects (`sgl.token_length_normalized`);
# here they are the method names select() accepts.
token_length_normalized = "token_length_normalized"
greedy_token_selection = "greedy_token_selection"
unconditional_likelihood_normalized = "unconditional_likelihood_normalized"
