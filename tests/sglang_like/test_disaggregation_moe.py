"""Prefill/decode disaggregation with a mixture-of-experts model (issue #52): a tiny seeded
Qwen3-MoE (transformers' own config class, benchmarks/tiny_families.py) served by a PD pair of
real Engines, KV moved by Mooncake over loopback, gives one worker's greedy tokens. The KV
of an MoE model is attention's like any other's; this proves the pair runs the routed layers
on the prefill side and decodes on them on the other."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.tiny_families import MOE_FAMILIES, build_folder
from sglang_like import Engine

from .test_disaggregation import _assert_idle, _free_port, _pd
from .test_hf_archs import tokenizer_json  # noqa: F401

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")


def test_moe_pair_matches_one_worker(tmp_path: Any, tokenizer_json: Any) -> None:  # noqa: F811
    build_folder(MOE_FAMILIES[0], tmp_path, tokenizer_json)
    port = _free_port()
    # fp32 experts (no packing) and a generous timeout: no timeout is tested here
    kw = {"model_path": str(tmp_path), "quantization": "none", "context_length": 256,
          "max_total_tokens": 2048, "log_level": "warning",
          "disaggregation_transfer_timeout": 60.0}
    prefill = Engine(disaggregation_mode="prefill", disaggregation_bootstrap_port=port, **kw)
    decode = Engine(disaggregation_mode="decode", **kw)
    try:
        text = "Experts on both sides of a pair:"
        sp = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        want = prefill.generate(text, sp)  # served whole by one worker
        assert prefill.flush_cache()  # the PD request prefills the whole prompt again
        out = _pd(prefill, decode, port, 91, text, sampling_params=sp)
        assert out["d"]["output_ids"] == want["output_ids"]
        assert len(want["output_ids"]) == 12
        info = decode.get_server_info()
        assert info["num_computed_prompt_tokens"] == 0  # the prompt arrived as KV
        assert info["disaggregation"]["num_transferred_tokens"] == (
            want["meta_info"]["prompt_tokens"])
        _assert_idle(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
