"""Where a quantized KV pool loses its top-1 agreement: K or V, and what moves it.

    python -m benchmarks.kv_error_budget [--tokens 3000] [--out bench_results/kv_error_budget.json]

bench_kv_dtype measures each `--kv-cache-dtype` end to end; this splits the loss. The
default model runs in transformers (float32, from the same GGUF) over bench_kv_dtype's text,
its keys (after RoPE) and values replaced by what a pool of each kind would hand back:
kv_quant's own codes (the rotation, one scale per token and head) read back as floats. The
baseline is a bf16 pool, as in bench_kv_dtype. Rows:

- K and V in the same kind (what `--kv-cache-dtype` does), then K alone, then V alone;
- fp8 without the rotation (one scale per row of the raw channels);
- two remedies tried for e4m3's keys: a per-layer, per-head key offset subtracted before
  quantizing and added back (the mean key of a calibration text: q . c is the same for every
  key of a query, so a pool could drop it), and the first tokens' keys kept in bf16 (the
  attention sinks).

Each row is a teacher-forced pass over the text: top-1 agreement with the bf16 pool and the
perplexity change. Single-threaded by default (it runs beside other work)."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.bench_kv_dtype import accuracy_text

KINDS = {"int8": torch.int8, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
CALIBRATION_PAGES = ["numbers", "strings", "lists", "dict", "comparisons", "booleans"]


class PoolModel:
    """transformers' Llama with its keys and values passed through a pool kind."""

    def __init__(self) -> None:
        import transformers.models.llama.modeling_llama as modeling
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from sglang_like.model_loader import default_model_path

        path = default_model_path()
        folder, name = os.path.dirname(path), os.path.basename(path)
        self.tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                          dtype=torch.float32).eval()
        self.head_dim = self.model.config.head_dim
        self.k_kind: str | None = "bf16"
        self.v_kind: str | None = "bf16"
        self.rotate = True
        self.offsets: dict[int, torch.Tensor] | None = None  # layer -> [Hkv, D]
        self.keep_first = 0
        self._collect: dict[int, list[torch.Tensor]] | None = None
        self._layer = 0
        rope = modeling.apply_rotary_pos_emb

        def keys_as_stored(q, k, cos, sin, *args, **kwargs):  # k [B, H, T, D]
            q, k = rope(q, k, cos, sin, *args, **kwargs)
            layer = self._layer
            self._layer = (layer + 1) % self.model.config.num_hidden_layers
            rows = k.transpose(1, 2)
            if self._collect is not None:
                self._collect.setdefault(layer, []).append(rows[0].mean(0))
                return q, k
            c = self.offsets[layer] if self.offsets is not None else 0.0
            stored = self.as_stored(rows - c, self.k_kind) + c
            if self.keep_first:
                stored[:, :self.keep_first] = rows[:, :self.keep_first].bfloat16().float()
            return q, stored.transpose(1, 2)

        modeling.apply_rotary_pos_emb = keys_as_stored
        for layer in self.model.model.layers:
            layer.self_attn.v_proj.register_forward_hook(self._values_as_stored)

    def _values_as_stored(self, module, inputs, out):
        shape = out.shape
        rows = out.view(*shape[:-1], -1, self.head_dim)
        return self.as_stored(rows, self.v_kind).view(shape)

    def as_stored(self, x: torch.Tensor, kind: str | None) -> torch.Tensor:
        """rows [..., D] as a pool of `kind` reads them back (None: unchanged)."""
        from sglang_like_kernels import kv_quant

        if kind is None:
            return x
        if kind == "bf16":
            return x.bfloat16().float()
        dtype = KINDS[kind]
        if self.rotate:
            return kv_quant.dequantize(*kv_quant.quantize(x.float(), dtype))
        scale = x.abs().amax(-1, keepdim=True) / kv_quant.QMAX[dtype]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = x / scale
        codes = y.round().clamp(-127, 127) if dtype == torch.int8 else y.to(dtype).float()
        return codes * scale

    @torch.no_grad()
    def calibrate(self, text: str, tokens: int) -> None:
        """self.offsets: each layer's mean key (after RoPE) per head over `text`."""
        self._collect, self._layer = {}, 0
        self.model(self.tokenizer(text, return_tensors="pt").input_ids[:, :tokens])
        self.offsets = {layer: torch.stack(means).mean(0) for layer, means in
                        self._collect.items()}
        self._collect = None

    @torch.no_grad()
    def run(self, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(top-1 ids at every position, perplexity) of the text, teacher-forced"""
        self._layer = 0
        logits = self.model(ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])
        return logits.argmax(-1), math.exp(-logp.mean().item())


def rows() -> list[dict[str, Any]]:
    """(name, settings) of every row, in print order"""
    out = [{"row": f"K {kind}, V {kind}", "k": kind, "v": kind} for kind in KINDS]
    out += [{"row": "K e4m3, V bf16", "k": "e4m3", "v": "bf16"},
            {"row": "K bf16, V e4m3", "k": "bf16", "v": "e4m3"},
            {"row": "K e4m3, V e4m3, not rotated", "k": "e4m3", "v": "e4m3", "rotate": False},
            {"row": "K e4m3 less a calibrated offset, V e4m3", "k": "e4m3", "v": "e4m3",
             "offsets": True},
            {"row": "K e4m3 less a calibrated offset, V bf16", "k": "e4m3", "v": "bf16",
             "offsets": True},
            {"row": "K e4m3, first 4 keys bf16, V e4m3", "k": "e4m3", "v": "e4m3", "keep": 4},
            {"row": "K e4m3, first 16 keys bf16, V bf16", "k": "e4m3", "v": "bf16",
             "keep": 16}]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import pydoc_data.topics as topics

    pm = PoolModel()
    ids = pm.tokenizer(accuracy_text(), return_tensors="pt").input_ids[:, :args.tokens]
    base, base_ppl = pm.run(ids)
    pm.calibrate("\n\n".join(topics.topics[p] for p in CALIBRATION_PAGES), 2000)
    calibrated = pm.offsets
    results = []
    for spec in tqdm(rows(), desc="pool kinds"):
        pm.k_kind, pm.v_kind = spec["k"], spec["v"]
        pm.rotate = spec.get("rotate", True)
        pm.offsets = calibrated if spec.get("offsets") else None
        pm.keep_first = spec.get("keep", 0)
        top1, ppl = pm.run(ids)
        results.append({"row": spec["row"], "top1": (top1 == base).float().mean().item(),
                        "perplexity_change": ppl / base_ppl - 1})
    print(f"\n{ids.shape[1]} tokens of bench_kv_dtype's text, float32 activations, "
          f"against a bf16 pool (perplexity {base_ppl:.3f})\n")
    print("| keys and values as stored | top-1 vs bf16 pool | perplexity |")
    print("|---|---|---|")
    for r in results:
        print(f"| {r['row']} | {100 * r['top1']:.2f}% | {100 * r['perplexity_change']:+.2f}% |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tokens": int(ids.shape[1]), "bf16_perplexity": base_ppl,
                       "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
