"""Prefill/decode disaggregation: SGLang's PD workers, behind sglang-router's PD mode.

`--disaggregation-mode prefill` makes a worker that computes prompts and sends their KV;
`decode` one that receives it and generates. sglang-router (`--pd-disaggregation --prefill
URL BOOTSTRAP_PORT --decode URL`) sends the same request to one of each, adding
`bootstrap_host`, `bootstrap_port` and `bootstrap_room`; the two workers then meet on the
prefill worker's bootstrap port (channel.py), the decode worker hands over the slots it
allocated, and the prefill worker writes each layer's KV into them with the Mooncake
Transfer Engine as soon as the layer is computed (transfer.py). The decode worker answers
the client. Requests without a bootstrap room are served whole by either kind of worker.

A worker changes role at run time without reloading the model (`switch_mode`; the command
`python -m sglang_like.disaggregation.switch_role` drains it behind the router first).
"""

from __future__ import annotations

from typing import Any

from sglang_like.config import DISAGGREGATION_MODES


def build_manager(mode: str, kv: Any, req_to_token_pool: Any, host: str, bootstrap_port: int,
                  timeout_s: float, wake: Any, secret: bytes, vocab_size: int,
                  loras: Any = None) -> Any:
    """The scheduler's `disagg` for `mode` (None for "null"); `secret`: the cluster's
    (channel.cluster_secret), `vocab_size`: the bound of a first token a decode worker takes,
    `loras`: the scheduler's LoraRegistry (None: LoRA off), which a prefill worker checks a
    registered room's adapter against."""
    if mode not in DISAGGREGATION_MODES:
        raise ValueError(f"disaggregation mode must be one of {', '.join(DISAGGREGATION_MODES)}"
                         f"; got {mode!r}")
    if mode == "prefill":
        from sglang_like.disaggregation.prefill import PrefillManager

        return PrefillManager(kv, req_to_token_pool, host, bootstrap_port, timeout_s, wake,
                              secret=secret, loras=loras)
    if mode == "decode":
        from sglang_like.disaggregation.decode import DecodeManager

        return DecodeManager(kv, timeout_s, wake, secret=secret, vocab_size=vocab_size)
    return None
