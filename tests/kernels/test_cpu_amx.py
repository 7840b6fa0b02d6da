"""The AMX int4 kernel (kernels/cpu/amx.c) against float64 math on the weights it defines.

It runs only where the CPU has AMX-BF16 and the OS grants tile state (Intel Sapphire Rapids
and later); elsewhere these tests skip and int4 runs torch's kernel, which
tests/sglang_like/test_quantization.py covers on every machine.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import kernels.cpu.amx as amx
from sglang_like.quant.int4 import Int4Method

pytestmark = pytest.mark.skipif(not amx.available(), reason="needs AMX-BF16 (and a C compiler)")


def _int4_layer(n: int, k: int, group: int, seed: int = 0) -> tuple[nn.Module, Int4Method]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    layer, method = nn.Module(), Int4Method(group)
    method.create_weights(layer, [w], torch.device("cpu"))
    assert layer.block_n == 64 and layer.amx
    return layer, method


def _reference(layer: nn.Module, method: Int4Method, x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes: each weight (code - 8) * scale + zero rounded once to fp32
    then to bf16, times the bf16 activations, summed in float64."""
    w = method.dequantize(layer).double().float().bfloat16()
    return x.double() @ w.double().T


@pytest.mark.parametrize("n,k,group", [(64, 32, 32), (128, 96, 32), (192, 576, 32),
                                       (128, 256, 64), (64, 1536, 128)])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 33, 70])
def test_q4_matmul_is_the_bf16_weights_times_the_activations(n, k, group, m):
    layer, method = _int4_layer(n, k, group, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    y = amx.q4_matmul(x, layer.weight, layer.scale_zero, group)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = _reference(layer, method, x)
    # fp32 accumulation, then one bf16 rounding of the output
    torch.testing.assert_close(y.double(), ref, rtol=2 ** -7, atol=1e-3)
    # and near what torch's int4 kernel returns (whose weights are not rounded to bf16)
    theirs = torch._weight_int4pack_mm_for_cpu(x, layer.weight, group, layer.scale_zero)
    assert ((y.float() - theirs.float()).norm() / theirs.float().norm()).item() < 0.01


def test_a_rows_result_does_not_depend_on_the_batch():
    layer, _ = _int4_layer(192, 576, 32)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    batch = amx.q4_matmul(x, layer.weight, layer.scale_zero, 32)
    for rows in (slice(0, 1), slice(7, 12), slice(33, 40), slice(3, 36)):
        assert torch.equal(amx.q4_matmul(x[rows], layer.weight, layer.scale_zero, 32),
                           batch[rows])


def test_strided_rows_float_input_and_bad_shapes():
    layer, method = _int4_layer(128, 96, 32)
    wide = torch.randn(9, 160, generator=torch.Generator().manual_seed(2))
    x = wide[:, 32:128]  # row stride 160
    y = amx.q4_matmul(x, layer.weight, layer.scale_zero, 32)  # float32 in: cast to bf16
    assert torch.equal(y, amx.q4_matmul(x.bfloat16().contiguous(), layer.weight,
                                        layer.scale_zero, 32))
    assert amx.q4_matmul(x[:0], layer.weight, layer.scale_zero, 32).shape == (0, 128)
    with pytest.raises(RuntimeError, match="must divide"):
        amx.q4_matmul(x, layer.weight[:96], layer.scale_zero, 32)


def test_int4_method_picks_amx_from_five_rows_and_everywhere_when_batch_invariant():
    layer, method = _int4_layer(128, 192, 32)
    x = torch.randn(8, 192, generator=torch.Generator().manual_seed(3)).bfloat16()
    w, sz = layer.weight, layer.scale_zero
    torch_op = torch._weight_int4pack_mm_for_cpu
    assert torch.equal(method.apply(layer, x), amx.q4_matmul(x, w, sz, 32))
    assert torch.equal(method.apply(layer, x[:4]), torch_op(x[:4], w, 32, sz))
    invariant = nn.Module()
    det = Int4Method(32, batch_invariant=True)
    det.create_weights(invariant, [method.dequantize(layer)], torch.device("cpu"))
    assert torch.equal(det.apply(invariant, x[:1]),
                       amx.q4_matmul(x[:1], invariant.weight, invariant.scale_zero, 32))


def test_env_var_turns_amx_off_and_rejects_unknown_values():
    code = "import kernels.cpu.amx as a; print(a.available())"
    for value, want in (("off", "False"), ("auto", "True")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "SGLANG_LIKE_AMX": value}, check=True)
        assert out.stdout.strip() == want
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "SGLANG_LIKE_AMX": "fast"})
    assert bad.returncode != 0 and "expected auto or off" in bad.stderr
