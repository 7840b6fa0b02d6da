"""Every Triton kernel compiles ahead of time to cubin for sm_90 and sm_80 on a CPU machine,
without register spills (ptxas's own `-v` figures).

Not collected on its own: test_triton_kernels.py runs it in a subprocess without
TRITON_INTERPRET (the interpreter replaces kernels with Python functions). The constexprs
come from the launchers' own *_meta helpers, so what compiles here is what runs on a GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise RuntimeError("cases_aot.py must run without TRITON_INTERPRET=1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sglang_like_kernels import triton_kernels as tk  # noqa: E402
from sglang_like_kernels import triton_ops  # noqa: E402

# Shared memory per block each architecture can give a kernel (bytes).
MAX_SHARED = {90: 227 * 1024, 80: 163 * 1024}
_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _signature(kernel, pointers: dict[str, str], constexprs: dict[str, object]) -> dict:
    """Argument types: listed pointers, constexprs, sm_scale and softcap fp32, every other
    int i32."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in ("sm_scale", "softcap") else "i32"
    return signature


def _spills(log: str) -> tuple[int, int]:
    """(spill store bytes, spill load bytes) over every function in a `ptxas -v` log."""
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert found, f"no spill figures in the ptxas log:\n{log}"
    return sum(int(a) for a, _ in found), sum(int(b) for _, b in found)


def _ptxas_log(ptx: str, capability: int) -> str:
    """`ptxas -v` of a kernel's PTX, as triton's compile runs it (for a cache hit, which
    compiles nothing)."""
    arch = re.search(r"^\.target (\S+)", ptx, re.M).group(1)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        run = subprocess.run([get_ptxas(capability).path, "-v", f"--gpu-name={arch}", f.name,
                              "-o", os.devnull], capture_output=True, text=True, check=True)
    return run.stderr + run.stdout


def _compile(kernel, pointers, constexprs, capability: int, capsys):
    """The kernel compiled for sm_`capability` with the runtime's signature; fails where
    ptxas spills registers to local memory (a slow kernel that still compiles)."""
    constexprs = dict(constexprs)
    options = {"num_warps": constexprs.pop("num_warps", 4)}  # a launch option, as launched
    src = ASTSource(kernel, _signature(kernel, pointers, constexprs), constexprs=constexprs)
    capsys.readouterr()
    knobs.nvidia.dump_ptxas_log = True
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", capability, 64),
                                  options=options)
    finally:
        knobs.nvidia.dump_ptxas_log = False
    log = capsys.readouterr().out
    if "spill" not in log:
        log = _ptxas_log(compiled.asm["ptx"], capability)
    stores, loads = _spills(log)
    assert stores == 0 and loads == 0, f"{kernel.__name__} spills on sm_{capability}:\n{log}"
    return compiled


def _attention_pointers(dtype: torch.dtype) -> dict[str, str]:
    # a quantized pool: bf16 queries and outputs, int8 codes or fp8 bytes in the pool
    t = _TYPES.get(dtype, "bf16")
    pool = {torch.int8: "i8", torch.float8_e4m3fn: "u8", torch.float8_e5m2: "u8"}.get(dtype, t)
    return {
        "q": t, "k_pool": pool, "v_pool": pool, "out": t, "req_to_token": "i32",
        "req_pool_indices": "i64", "seq_lens": "i64", "prefix_lens": "i64",
        "extend_lens": "i64", "extend_starts": "i64", "tree_mask": "i8",
        "mid_out": "fp32", "mid_lse": "fp32", "k_scale": "fp32", "v_scale": "fp32",
        "mask_meta": "i64", "masks": "i8",
    }  # fmt: skip


def _decode_split(dtype, head_dim, group, window=None, softcap=None):
    meta = triton_ops.decode_meta(group * 2, 2, head_dim, 4096, dtype, interpret=False,
                                  window=window, softcap=softcap)
    meta.pop("BLOCK_S")
    return tk.decode_split_kernel, _attention_pointers(dtype), meta


def _split_reduce(dtype, head_dim, group):
    # decode's 16 splits, the most any launcher asks for (verify and masked use it too)
    meta = triton_ops.decode_meta(group * 2, 2, head_dim, 4096, dtype, interpret=False)
    consts = {k: meta[k] for k in ("NUM_SPLITS", "BLOCK_S", "BLOCK_D")}
    return tk.split_reduce_kernel, _attention_pointers(dtype), consts


def _extend(dtype, head_dim, group, window=None, softcap=None):
    meta = triton_ops.extend_meta(head_dim, dtype, interpret=False, window=window,
                                  softcap=softcap)
    return tk.extend_kernel, _attention_pointers(dtype), meta


def _split(meta: dict[str, object], split: bool) -> dict[str, object]:
    """A prefix-splitting kernel's constexprs (less the reduce's BLOCK_S): the many-split
    kind (partials) or the one-split kind (writes the output), as asked."""
    assert (meta["NUM_SPLITS"] > 1) == split
    return {k: v for k, v in meta.items() if k != "BLOCK_S"}


# A verify batch of 1 over a 32k table splits its prefix 16 ways; one of 64 (1,024 programs of
# B * Hkv * row blocks) is not split.
def _tree_verify(dtype, head_dim, group, window=None, softcap=None, batch=1):
    # 12 drafts x the group's query heads of a kv head: two blocks of 32 rows (fp32 dots: a
    # program per query head, 16 rows)
    meta = triton_ops.tree_verify_meta(12, head_dim, dtype, interpret=False, window=window,
                                       softcap=softcap, max_context=32768,
                                       num_programs=batch * 8 * 2, group=group)
    assert (meta["HEADS"], meta["BLOCK_R"]) == ((1, 16) if dtype == torch.float32 else (group, 32))
    return tk.tree_verify_kernel, _attention_pointers(dtype), _split(meta, batch == 1)


def _tree_verify_one_split(dtype, head_dim, group):
    return _tree_verify(dtype, head_dim, group, batch=64)


def _masked(dtype, head_dim, group, window=None, softcap=None, batch=1):
    meta = triton_ops.masked_meta(head_dim, dtype, interpret=False, window=window,
                                  softcap=softcap, max_context=32768,
                                  num_programs=batch * group * 8)
    return tk.masked_kernel, _attention_pointers(dtype), _split(meta, batch == 1)


def _masked_one_split(dtype, head_dim, group):
    return _masked(dtype, head_dim, group, batch=64)


def _store_kv(dtype, head_dim, group):
    t = _TYPES[dtype]
    pointers = {"k_pool": t, "v_pool": t, "slot_ids": "i64", "k": t, "v": t}
    consts = {"BLOCK_H": 8, "BLOCK_D": triton.next_power_of_2(head_dim)}
    return tk.store_kv_kernel, pointers, consts


def _bitmask(dtype, head_dim, group):
    pointers = {"logits": _TYPES[dtype], "bitmask": "i32"}
    return tk.token_bitmask_kernel, pointers, {"BLOCK": 1024}


def _lora_shrink(dtype, head_dim, group):
    meta = triton_ops.lora_meta(48)
    pointers = {"x": _TYPES[dtype], "a": _TYPES[dtype], "slots": "i64", "u": "fp32"}
    return tk.lora_shrink_kernel, pointers, {k: meta[k] for k in ("BLOCK_R", "BLOCK_K")}


def _lora_expand(dtype, head_dim, group):
    meta = triton_ops.lora_meta(48)
    pointers = {"u": "fp32", "b": _TYPES[dtype], "slots": "i64", "y": _TYPES[dtype]}
    return tk.lora_expand_kernel, pointers, {k: meta[k] for k in ("BLOCK_N", "BLOCK_R")}


def _moe_pointers(dtype: torch.dtype, out: str) -> dict[str, str]:
    t = _TYPES[dtype]
    return {"a": t, "w": t, "out": out, "routing_weights": "fp32", "sorted_pair_ids": "i32",
            "block_expert_ids": "i32", "num_padded": "i64"}


def _moe_gate_up(dtype, head_dim, group):
    # a decode step's shape (8 pairs over 64 experts: BLOCK_M 16); out in the weights' dtype
    meta = triton_ops.fused_moe_meta(8, 64, dtype, interpret=False)
    assert meta["BLOCK_M"] == 16
    return (tk.fused_moe_gemm_kernel, _moe_pointers(dtype, _TYPES[dtype]),
            {**meta, "MUL_ROUTING_WEIGHT": False})


def _moe_down(dtype, head_dim, group):
    # a prefill's (4096 pairs over 64 experts: BLOCK_M 64); routing weights, float32 out
    meta = triton_ops.fused_moe_meta(4096, 64, dtype, interpret=False)
    assert meta["BLOCK_M"] == 64
    return tk.fused_moe_gemm_kernel, _moe_pointers(dtype, "fp32"), {**meta,
                                                                    "MUL_ROUTING_WEIGHT": True}


BUILDERS = [_decode_split, _split_reduce, _extend, _tree_verify, _tree_verify_one_split, _masked,
            _masked_one_split, _store_kv, _bitmask, _lora_shrink, _lora_expand, _moe_gate_up,
            _moe_down]
# fp16 takes the same code path as bf16; fp32 the exact-dot one with a masked head dim.
CONFIGS = [(torch.bfloat16, 128, 4), (torch.float32, 80, 3)]


@pytest.mark.parametrize("capability", [90, 80])
@pytest.mark.parametrize("builder", BUILDERS, ids=lambda b: b.__name__.strip("_"))
@pytest.mark.parametrize("dtype,head_dim,group", CONFIGS, ids=["bf16", "fp32"])
def test_compiles_for_target(builder, dtype, head_dim, group, capability, capsys):
    kernel, pointers, constexprs = builder(dtype, head_dim, group)
    compiled = _compile(kernel, pointers, constexprs, capability, capsys)
    assert len(compiled.asm["cubin"]) > 0
    assert kernel.__name__ in compiled.asm["ptx"]
    assert compiled.metadata.shared <= MAX_SHARED[capability]


@pytest.mark.parametrize("capability", [90, 80])
@pytest.mark.parametrize("builder", [_decode_split, _extend, _tree_verify, _masked],
                         ids=lambda b: b.__name__.strip("_"))
@pytest.mark.parametrize("dtype,head_dim,group", CONFIGS, ids=["bf16", "fp32"])
def test_window_and_softcap_variants_compile(builder, dtype, head_dim, group, capability,
                                             capsys):
    """The attention kernels with their sliding-window and soft-cap switches on (Gemma 2's
    local layers) compile too, within the same shared memory."""
    kernel, pointers, constexprs = builder(dtype, head_dim, group, window=4096, softcap=50.0)
    assert constexprs["USE_WINDOW"] and constexprs["USE_SOFTCAP"]
    compiled = _compile(kernel, pointers, constexprs, capability, capsys)
    assert len(compiled.asm["cubin"]) > 0
    assert compiled.metadata.shared <= MAX_SHARED[capability]


@pytest.mark.parametrize("capability", [90, 80])
@pytest.mark.parametrize("builder", [_decode_split, _extend, _tree_verify, _masked],
                         ids=lambda b: b.__name__.strip("_"))
@pytest.mark.parametrize("pool_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["int8", "e4m3", "e5m2"])
def test_quantized_pool_variants_compile(builder, pool_dtype, capability, capsys):
    """The attention kernels over a quantized pool (codes, fp8 as bytes, and float32 scales;
    bf16 dots) compile for the GPU too."""
    kernel, pointers, constexprs = builder(pool_dtype, 128, 4)
    assert constexprs["KV_KIND"] > 0
    compiled = _compile(kernel, pointers, constexprs, capability, capsys)
    assert len(compiled.asm["cubin"]) > 0
    assert compiled.metadata.shared <= MAX_SHARED[capability]
