"""A PEFT LoRA adapter read from disk and fitted to the served model's linears.

PEFT saves `adapter_config.json` (rank, `lora_alpha`, rsLoRA, targets) and
`adapter_model.safetensors` with tensors named
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]); the delta it applies is `scale * B @ A @ x` with scale `alpha / r`
(`alpha / sqrt(r)` with rsLoRA). Here each adapter's B goes through the family's own
`adapt_hf_weights` (the row splits and reorders its base weights get at load: Phi-3's fused
q/k/v, partial-rotary row orders), so an adapter fits whatever the base checkpoint's format.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from sglang_like.config import ModelConfig
from sglang_like.layers.lora import LoraLinearWeights
from sglang_like.models.registry import model_class

__all__ = ["LORA_TARGETS", "LoraAdapter", "LoraAdapterError", "parse_lora_paths", "read_adapter"]

# Hugging Face module name -> (our linear, which sub-layer); fused names of families whose
# checkpoints fuse (Phi-3) are split by the family's adapt_hf_weights
_LINEARS = {
    "q_proj": "self_attn.qkv_proj", "k_proj": "self_attn.qkv_proj",
    "v_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_up_proj", "up_proj": "mlp.gate_up_proj",
    "down_proj": "mlp.down_proj",
}
_FUSED = {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}
LORA_TARGETS = (*_LINEARS, *_FUSED)
"""Module names an adapter may target (`--lora-target-modules` takes these, or "all")."""
_SUB = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
        "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
        **_FUSED}
_OWNER = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
                   r"(lora_A|lora_B)(?:\.[A-Za-z0-9_-]+)?\.weight$")


class LoraAdapterError(ValueError):
    """An adapter that cannot be served on this model (the message names why)."""


@dataclass
class LoraAdapter:
    """An adapter fitted to the model: per linear key (the module path of one of the model's
    fused QuantLinears, e.g. `model.layers.3.self_attn.qkv_proj`), its stacked low-rank pair."""

    name: str
    path: str
    rank: int  # the largest module rank
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    weights: dict[str, LoraLinearWeights]

    def to(self, device: torch.device | str) -> LoraAdapter:
        """The adapter with its weights on `device` (the model's)."""
        weights = {k: LoraLinearWeights(w.a.to(device), w.b.to(device))
                   for k, w in self.weights.items()}
        return LoraAdapter(self.name, self.path, self.rank, self.alpha, self.use_rslora,
                           self.target_modules, weights)

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "rank": self.rank, "alpha": self.alpha,
                "use_rslora": self.use_rslora, "target_modules": list(self.target_modules),
                "bytes": self.nbytes}

    # the engine process gets the adapter as plain data (it crosses a msgspec pipe)
    def to_payload(self) -> dict[str, Any]:
        def pack(t: torch.Tensor) -> list[Any]:
            return [list(t.shape), t.contiguous().numpy().tobytes()]

        return {**{k: v for k, v in self.info().items() if k != "bytes"},
                "weights": {k: [pack(w.a), pack(w.b)] for k, w in self.weights.items()}}

    @staticmethod
    def from_payload(p: dict[str, Any]) -> LoraAdapter:
        def unpack(item: list[Any]) -> torch.Tensor:
            shape, data = item
            return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)

        weights = {k: LoraLinearWeights(unpack(a), unpack(b)) for k, (a, b) in p["weights"].items()}
        return LoraAdapter(p["name"], p["path"], int(p["rank"]), float(p["alpha"]),
                           bool(p["use_rslora"]), tuple(p["target_modules"]), weights)


def _read_config(path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise LoraAdapterError(f"LoRA adapter path {path!r} is not a folder")
    if not os.path.isfile(cfg_path):
        raise LoraAdapterError(f"{path!r} has no adapter_config.json (a PEFT adapter folder "
                               f"is expected)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(f"{cfg_path}: unreadable ({exc})") from exc
    if not isinstance(cfg, dict):
        raise LoraAdapterError(f"{cfg_path}: not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraAdapterError(f"{path!r} is a {peft_type} adapter; only LoRA is served")
    if cfg.get("use_dora"):
        raise LoraAdapterError(f"{path!r} is a DoRA adapter (use_dora), which is not served")
    if cfg.get("fan_in_fan_out"):
        raise LoraAdapterError(f"{path!r} has fan_in_fan_out (GPT-2 Conv1D layers): not served")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoraAdapterError(f"{path!r} trains biases (bias={cfg['bias']!r}): not served")
    saved = cfg.get("modules_to_save") or []
    if saved:
        raise LoraAdapterError(f"{path!r} saves whole modules {list(saved)} (modules_to_save): "
                               f"not served")
    targets = cfg.get("target_modules")
    names = targets if isinstance(targets, list) else [targets] if targets else []
    for refused in ("embed_tokens", "lm_head"):
        if any(refused in str(t) for t in names):
            raise LoraAdapterError(f"{path!r} targets {refused}: embedding and LM-head adapters "
                                   f"are not served")
    return cfg


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    bin_path = os.path.join(path, "adapter_model.bin")
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file

            return load_file(st)
        if os.path.isfile(bin_path):
            return torch.load(bin_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a corrupt file is the caller's bad input
        raise LoraAdapterError(f"{path!r}: its adapter weights are unreadable "
                               f"({type(exc).__name__}: {exc})") from exc
    raise LoraAdapterError(f"{path!r} has no adapter_model.safetensors (or .bin)")


def _pattern_value(patterns: dict[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's rank/alpha patterns: the value of the first key the module path ends with."""
    for key, value in (patterns or {}).items():
        if module == key or module.endswith("." + key) or re.fullmatch(key, module):
            return value
    return default


def read_adapter(name: str, path: str, config: ModelConfig, *, max_rank: int | None = None,
                 target_modules: tuple[str, ...] | None = None) -> LoraAdapter:
    """Read the PEFT adapter at `path` and fit it to a model of `config` (one rank, no TP).

    LoraAdapterError (a ValueError) when it cannot be served: not a LoRA folder, DoRA,
    embedding / LM-head / modules_to_save parts, a module this runtime has no linear for,
    one `target_modules` leaves out, a rank above `max_rank`, or shapes that do not fit."""
    path = os.path.abspath(os.path.expanduser(path))
    cfg = _read_config(path)
    tensors = _read_tensors(path)
    alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))
    rslora = bool(cfg.get("use_rslora", False))
    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_embedding" in key or "lora_magnitude" in key:
            raise LoraAdapterError(f"{path!r}: {key} is an embedding or DoRA part: not served")
        m = _NAME.match(key)
        if m is None:
            raise LoraAdapterError(f"{path!r}: tensor {key!r} is not a LoRA A/B of a decoder "
                                   f"layer's linear")
        layer, sub, module, kind = int(m[1]), m[2], m[3], m[4]
        if module not in _SUB or _SUB[module] != sub:
            raise LoraAdapterError(f"{path!r}: {sub}.{module} is not a linear this runtime "
                                   f"adapts (targets: {', '.join(LORA_TARGETS)})")
        if target_modules is not None and module not in target_modules:
            raise LoraAdapterError(f"{path!r} targets {module}, which --lora-target-modules "
                                   f"({', '.join(target_modules)}) leaves out")
        if layer >= config.num_hidden_layers:
            raise LoraAdapterError(f"{path!r}: layer {layer} is past the model's "
                                   f"{config.num_hidden_layers} layers")
        if sub == "mlp" and config.layer_is_moe(layer):
            raise LoraAdapterError(f"{path!r} adapts {module} of layer {layer}, a mixture of "
                                   "experts: LoRA on experts is not served (attention only)")
        pairs.setdefault((layer, sub, module), {})[kind] = tensor.float()
    if not pairs:
        raise LoraAdapterError(f"{path!r} holds no LoRA weights")

    # A per HF module; B scaled, under the base weight's name, through the family's adapter
    a_of: dict[tuple[int, str], torch.Tensor] = {}
    b_named: dict[str, torch.Tensor] = {}
    max_r = 0
    for (layer, sub, module), ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoraAdapterError(f"{path!r}: layer {layer} {module} lacks its "
                                   f"{'lora_B' if 'lora_A' in ab else 'lora_A'}")
        a, b = ab["lora_A"], ab["lora_B"]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise LoraAdapterError(f"{path!r}: layer {layer} {module}: A {tuple(a.shape)} and "
                                   f"B {tuple(b.shape)} are not a rank-r pair")
        max_r = max(max_r, r)
        full = f"model.layers.{layer}.{sub}.{module}"
        mod_alpha = float(_pattern_value(cfg.get("alpha_pattern"), full, alpha))
        scale = mod_alpha / (math.sqrt(r) if rslora else r)
        a_of[(layer, module)] = a
        b_named[f"{full}.weight"] = b * scale
    if max_rank is not None and max_r > max_rank:
        raise LoraAdapterError(f"{path!r} has rank {max_r}, above --max-lora-rank {max_rank}")
    cls = model_class(config.architecture)
    cls.adapt_hf_weights(config, b_named)

    hd = config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    inter, hidden = config.intermediate_size, config.hidden_size
    # our linears: partitions in order with their rows, and the input width
    layout = {"self_attn.qkv_proj": ((("q_proj", q), ("k_proj", kv), ("v_proj", kv)), hidden),
              "self_attn.o_proj": ((("o_proj", hidden),), q),
              "mlp.gate_up_proj": ((("gate_proj", inter), ("up_proj", inter)), hidden),
              "mlp.down_proj": ((("down_proj", hidden),), inter)}
    weights: dict[str, LoraLinearWeights] = {}
    for layer in range(config.num_hidden_layers):
        for linear, (parts, width) in layout.items():
            sub = linear.split(".")[0]
            a_list: list[torch.Tensor] = []
            placed: list[tuple[int, int, torch.Tensor, int]] = []  # (row, rows, B, a index)
            row = 0
            for part, rows in parts:
                b = b_named.pop(f"model.layers.{layer}.{sub}.{part}.weight", None)
                if b is not None:
                    a = a_of.get((layer, part))
                    if a is None:
                        a = a_of.get((layer, _OWNER.get(part, part)))
                    if a is None or a.shape[1] != width or b.shape[0] != rows:
                        got = "none" if a is None else f"{tuple(a.shape)}"
                        raise LoraAdapterError(
                            f"{path!r}: layer {layer} {part}: A {got}, B {tuple(b.shape)} do "
                            f"not fit the model's [{rows} x {width}] (another base model?)")
                    index = next((i for i, x in enumerate(a_list) if x is a), None)
                    if index is None:
                        index = len(a_list)
                        a_list.append(a)
                    placed.append((row, rows, b, index))
                row += rows
            if not placed:
                continue
            offsets = [0]
            for x in a_list:
                offsets.append(offsets[-1] + x.shape[0])
            a_cat = torch.cat(a_list).contiguous()
            b_full = torch.zeros(row, offsets[-1])
            for start, rows, b, index in placed:
                b_full[start:start + rows, offsets[index]:offsets[index + 1]] = b
            weights[f"model.layers.{layer}.{linear}"] = LoraLinearWeights(a_cat, b_full)
    if b_named:  # adapt_hf_weights left a name no linear takes
        raise LoraAdapterError(f"{path!r}: {sorted(b_named)[0]} fits no linear of the model")
    targets = tuple(sorted({m for (_, _, m) in pairs}))
    return LoraAdapter(name, path, max_r, alpha, rslora, targets, weights)


def parse_lora_paths(entries: tuple[str, ...] | list[str]) -> list[tuple[str, str, bool]]:
    """(name, path, pinned) of each `--lora-paths` entry: "name=path", a bare path (its own
    name, as SGLang names it), or SGLang's JSON object with lora_name, lora_path, pinned."""
    out: list[tuple[str, str, bool]] = []
    for entry in entries:
        entry = str(entry).strip()
        if entry.startswith("{"):
            try:
                obj = json.loads(entry)
                name, path = str(obj["lora_name"]), str(obj["lora_path"])
            except (ValueError, KeyError, TypeError) as exc:
                raise LoraAdapterError(f"--lora-paths entry {entry!r}: a JSON entry needs "
                                       f"lora_name and lora_path ({exc})") from exc
            out.append((name, path, bool(obj.get("pinned", False))))
        elif "=" in entry:
            name, _, path = entry.partition("=")
            out.append((name.strip(), path.strip(), False))
        else:
            out.append((entry, entry, False))
    names = [n for n, _, _ in out]
    if any(not n for n in names) or len(set(names)) != len(names):
        raise LoraAdapterError(f"--lora-paths: adapter names must be non-empty and distinct "
                               f"(got {names})")
    return out
