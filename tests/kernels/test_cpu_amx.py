"""The AMX kernels (kernels/sglang_like_kernels/cpu/amx.c) against float64 math on the weights
they define.

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

import sglang_like_kernels.cpu.amx as amx
from sglang_like.layers.quantization.int4 import Int4Method
from sglang_like.layers.quantization.int8 import quantize_blocks_int8
from sglang_like.layers.quantization.q8_head import Q8HeadMethod

pytestmark = pytest.mark.skipif(not amx.available(), reason="needs AMX-BF16 (and a C compiler)")


def _int4_layer(n: int, k: int, group: int, seed: int = 0) -> tuple[nn.Module, Int4Method]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    layer, method = nn.Module(), Int4Method(group)
    method.create_weights(layer, [w], torch.device("cpu"))
    assert layer.block_n == 64 and layer.amx
    return layer, method


def _exact(layer: nn.Module, method: Int4Method, x: torch.Tensor) -> torch.Tensor:
    """The float64 product of the bf16 activations and the weights the codes hold."""
    return x.double() @ method.dequantize(layer).double().T


@pytest.mark.parametrize("n,k,group", [(64, 32, 32), (128, 96, 32), (192, 576, 32),
                                       (128, 256, 64), (64, 1536, 128)])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 33, 70])
def test_q4_bf16_kernel_is_as_exact_as_the_bf16_output(n, k, group, m):
    """Weights as two bf16 parts: what is left of the float64 product is the bf16 output's
    rounding (relative error ~2^-9), as for torch's kernel."""
    layer, method = _int4_layer(n, k, group, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    y = amx.q4_matmul(x, layer.weight, layer.scale_zero, group)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    exact = _exact(layer, method, x)
    torch.testing.assert_close(y.double(), exact, rtol=2 ** -7, atol=1e-4)
    assert ((y.double() - exact).norm() / exact.norm()).item() < 2.5e-3
    theirs = torch._weight_int4pack_mm_for_cpu(x, layer.weight, group, layer.scale_zero)
    assert ((theirs.double() - exact).norm() / exact.norm()).item() < 2.5e-3


@pytest.mark.parametrize("n,k,group", [(64, 32, 32), (128, 96, 32), (192, 576, 32),
                                       (128, 256, 64), (64, 1536, 128)])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 16, 17, 33])
def test_q4_codes_kernel_is_as_exact_as_the_bf16_output(n, k, group, m):
    """Activations on a grid of 2^-14 of their block's power of two, codes as exact
    integers (on VNNI up to 4 rows, on the tiles above): what is left of the float64
    product is the bf16 output's rounding (relative error ~2^-9), as for torch's kernel."""
    kernel = "codes"
    layer, method = _int4_layer(n, k, group, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    y = amx.q4_matmul(x, layer.weight, layer.scale_zero, group, kernel)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    exact = _exact(layer, method, x)
    torch.testing.assert_close(y.double(), exact, rtol=2 ** -7, atol=1e-4)
    assert ((y.double() - exact).norm() / exact.norm()).item() < 2.5e-3
    # a block whose values span 2^12 keeps its small ones (one int8 part would zero them;
    # here they keep 2^-15 of the block's largest)
    spiky = x.clone()
    spiky[:, ::32] = 1000.0
    y = amx.q4_matmul(spiky, layer.weight, layer.scale_zero, group, kernel)
    exact = _exact(layer, method, spiky)
    torch.testing.assert_close(y.double(), exact, rtol=2 ** -7, atol=0.05)


@pytest.mark.parametrize("kernel", amx.Q4_KERNELS)
def test_a_rows_result_does_not_depend_on_the_batch(kernel):
    layer, _ = _int4_layer(192, 576, 32)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[5, ::32] = 300.0  # a row whose blocks round its other values onto a coarser grid
    batch = amx.q4_matmul(x, layer.weight, layer.scale_zero, 32, kernel)
    for rows in (slice(0, 1), slice(3, 7), slice(4, 8), slice(7, 12), slice(33, 40),
                 slice(3, 36), slice(38, 40)):
        assert torch.equal(amx.q4_matmul(x[rows], layer.weight, layer.scale_zero, 32, kernel),
                           batch[rows])


def test_strided_rows_float_input_and_bad_shapes():
    layer, method = _int4_layer(128, 96, 32)
    wide = torch.randn(9, 160, generator=torch.Generator().manual_seed(2))
    x = wide[:, 32:128]  # row stride 160
    y = amx.q4_matmul(x, layer.weight, layer.scale_zero, 32)  # float32 in: cast to bf16
    assert torch.equal(y, amx.q4_matmul(x.bfloat16().contiguous(), layer.weight,
                                        layer.scale_zero, 32))
    assert amx.q4_matmul(x[:0], layer.weight, layer.scale_zero, 32).shape == (0, 128)
    for kernel in amx.Q4_KERNELS:
        with pytest.raises(RuntimeError, match="must divide"):
            amx.q4_matmul(x, layer.weight[:96], layer.scale_zero, 32, kernel)
    with pytest.raises(ValueError, match="expected one of"):
        amx.q4_matmul(x, layer.weight, layer.scale_zero, 32, "int4")


def test_int4_method_picks_its_kernel_by_row_count():
    """The codes kernel below 256 rows (one row included), the bf16 one from there; batch
    invariant: the codes kernel at every row count."""
    layer, method = _int4_layer(128, 192, 32)
    x = torch.randn(300, 192, generator=torch.Generator().manual_seed(3)).bfloat16()
    w, sz = layer.weight, layer.scale_zero
    for rows, kernel in ((1, "codes"), (2, "codes"), (33, "codes"), (64, "codes"),
                         (255, "codes"), (256, "bf16"), (300, "bf16")):
        want = amx.q4_matmul(x[:rows], w, sz, 32, kernel)
        assert torch.equal(method.apply(layer, x[:rows]), want), (rows, kernel)
    # the kernels' float sums differ: a switch is visible in the last bits
    assert not torch.equal(amx.q4_matmul(x[:64], w, sz, 32, "codes"),
                           amx.q4_matmul(x[:64], w, sz, 32, "bf16"))
    invariant = nn.Module()
    det = Int4Method(32, batch_invariant=True)
    det.create_weights(invariant, [method.dequantize(layer)], torch.device("cpu"))
    assert torch.equal(det.apply(invariant, x),
                       amx.q4_matmul(x, invariant.weight, invariant.scale_zero, 32, "codes"))


def test_codes_kernel_gives_nan_for_a_non_finite_block_and_zero_for_a_tiny_one():
    layer, _ = _int4_layer(64, 64, 32)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    x[1, 3] = float("inf")
    x[2, 40] = float("nan")
    x[3, :32] = 1e-35  # below 2^-100: taken as zeros
    for rows in (slice(0, 6), slice(1, 4)):  # tiles, VNNI
        y = amx.q4_matmul(x[rows], layer.weight, layer.scale_zero, 32, "codes")
        assert torch.isnan(y[1 - rows.start]).all() and torch.isnan(y[2 - rows.start]).all()
        assert torch.isfinite(y[3 - rows.start]).all()
        tiny = x[3:4].clone()
        tiny[:, :32] = 0
        assert torch.equal(y[3 - rows.start],
                           amx.q4_matmul(tiny, layer.weight, layer.scale_zero, 32, "codes")[0])


def test_env_var_turns_amx_off_and_rejects_unknown_values():
    code = "import sglang_like_kernels.cpu.amx as a; print(a.available())"
    for value, want in (("off", "False"), ("auto", "True")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "SGLANG_LIKE_AMX": value}, check=True)
        assert out.stdout.strip() == want
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "SGLANG_LIKE_AMX": "fast"})
    assert bad.returncode != 0 and "expected auto or off" in bad.stderr


def _q8_matrix(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, the float matrix they hold)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    codes, scales = quantize_blocks_int8(w)
    return codes, scales, (codes.float().view(n, -1, 32) * scales[..., None]).view(n, k)


@pytest.mark.parametrize("n,k", [(32, 32), (96, 64), (256, 576)])
@pytest.mark.parametrize("m", [1, 4, 5, 16, 17, 33, 64])
@pytest.mark.parametrize("int8", [False, True])
def test_q8_matmul_keeps_the_float_product(n, k, m, int8):
    """bf16 kernel: weights and activations as two bf16 parts each, the float64 product to
    16 bits. Integer kernel: the codes exact, activations as two int8 parts per 32 columns
    (about 15 bits). Both as close as the native kernel's float32 sums, to within a few
    1e-5 of the norm."""
    codes, scales, w = _q8_matrix(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    y = amx.q8_matmul(x, codes, scales, int8=int8)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    exact = x.double() @ w.double().T
    assert ((y.double() - exact).norm() / exact.norm()).item() < (5e-5 if int8 else 2e-5)
    torch.testing.assert_close(y.double(), exact, rtol=1e-4, atol=(5e-4 if int8 else 1e-4))


@pytest.mark.parametrize("int8", [False, True])
def test_q8_rows_do_not_depend_on_the_batch_and_bad_shapes_are_refused(int8):
    """Row subsets cross the integer kernel's VNNI / tile cut (4 rows) and its 16-row tiles:
    every row's sums are the same bits alone or in any batch."""
    codes, scales, _ = _q8_matrix(64, 96, seed=0)
    wide = torch.randn(37, 128, generator=torch.Generator().manual_seed(4))
    x = wide[:, :96]  # row stride 128
    batch = amx.q8_matmul(x, codes, scales, int8=int8)
    for rows in (slice(0, 1), slice(3, 7), slice(5, 21), slice(30, 37)):
        assert torch.equal(amx.q8_matmul(x[rows].contiguous(), codes, scales, int8=int8),
                           batch[rows])
    with pytest.raises(RuntimeError, match="must divide by 32"):
        amx.q8_matmul(x, codes[:48], scales[:48], int8=int8)


def test_row_major_q8_head_picks_integer_below_24_rows_bf16_above_unless_batch_invariant():
    codes, scales, w = _q8_matrix(128, 64, seed=1)
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(5))
    for invariant in (False, True):
        layer, method = nn.Module(), Q8HeadMethod(batch_invariant=invariant, row_major_amx=True)
        method.create_weights(layer, [w], torch.device("cpu"))
        assert layer.amx and not layer.x16 and method.row_major_amx_min_rows == 24
        for rows in (1, 23):
            assert torch.equal(method.apply(layer, x[:rows]),
                               amx.q8_matmul(x[:rows], codes, scales, int8=True))
        assert torch.equal(method.apply(layer, x),
                           amx.q8_matmul(x, codes, scales, int8=invariant))


# ---- amx_kq.c: the x16 layout (Q4_1, int8 activations) on AMX-INT8 tiles ------------------

def _x16_matrix(n: int, k: int, seed: int) -> torch.Tensor:
    from sglang_like.layers.quantization.q4_native import q4_1_blocks
    from sglang_like_kernels import cpu as native_cpu

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return native_cpu.q4_x16_pack(q4_1_blocks(w), n, k)


@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("m", [1, 4, 15, 16, 17, 31, 33, 128, 129, 300])
def test_q4_x16_tiles_are_the_x16_kernels_bits(n, k, m):
    """The tile kernel and the x16 kernel (VNNI; the AVX2 build too) give the same bits, row
    for row, at every row count: `auto` switches between them by rows with no output moving.
    Activations of mixed scales, a zero block and a row of zeros included."""
    from sglang_like_kernels import cpu as native_cpu

    packed = _x16_matrix(n, k, seed=n + k)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 8
    x[0, :32] = 0
    x[m // 2] = 0
    y = amx.q4_x16_matmul(x, packed, n)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert torch.equal(y, native_cpu.q4_x16_matmul(x, packed, n))
    if "avx2" in native_cpu.supported_isas():
        assert torch.equal(y, native_cpu.q4_x16_matmul(x, packed, n, variant="avx2"))


def test_q4_x16_tiles_rows_do_not_depend_on_the_batch_and_bad_shapes_are_refused():
    n, k = 96, 576
    packed = _x16_matrix(n, k, seed=1)
    x = torch.randn(70, 2 * k)[:, :k]  # a row stride other than K
    batch = amx.q4_x16_matmul(x, packed, n)
    for rows in (slice(0, 1), slice(3, 20), slice(17, 70)):
        assert torch.equal(amx.q4_x16_matmul(x[rows], packed, n), batch[rows])
    assert amx.q4_x16_matmul(x[:0], packed, n).shape == (0, n)
    with pytest.raises(RuntimeError, match="q4_x16_amx_matmul"):
        amx.q4_x16_matmul(torch.randn(4, 48), packed, n)  # K not a multiple of 32


def test_x16_method_takes_the_tiles_from_amx_min_rows_and_never_a_dense_gemm(monkeypatch):
    """On AMX a Q4X16Method layer multiplies every row count on the x16 bytes (x16 kernel
    below `amx_min_rows`, tiles from there): the same bits in any batch, prefill chunks of
    256+ rows included, where it used to dequantize for a bf16 GEMM."""
    from sglang_like.layers.quantization.q4_native import Q4X16Method
    from sglang_like_kernels import cpu as native_cpu

    method, layer = Q4X16Method(), nn.Module()
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(3)) * 0.05
    method.create_weights(layer, [w], torch.device("cpu"))
    layer.bias = None
    assert layer.amx
    calls = []
    for name in ("q4_x16_matmul",):
        for mod, tag in ((native_cpu, "x16"), (amx, "tiles")):
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, lambda *a, _r=real, _t=tag: calls.append(_t) or _r(*a))
    monkeypatch.setattr(method, "dequantize", lambda layer: pytest.fail("dense GEMM"))
    x = torch.randn(300, 576)
    whole = method.apply(layer, x)
    decode = method.decode_fn(layer)
    for rows in (1, method.amx_min_rows - 1, method.amx_min_rows, 256):
        del calls[:]
        assert torch.equal(method.apply(layer, x[:rows]), whole[:rows])
        assert torch.equal(decode(x[:rows]), whole[:rows])
        want = "tiles" if rows >= method.amx_min_rows else "x16"
        assert calls == [want, want], (rows, calls)


# ---- amx_q8x16.c: the head's q8 x16 layout on AMX-INT8 tiles ---------------------------------

@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (512, 576)])
@pytest.mark.parametrize("m", [1, 5, 8, 16, 17, 33, 130])
def test_q8_x16_tiles_are_the_x16_kernels_bits(n, k, m):
    """The head's tile kernel gives the x16 kernel's logits bit for bit (its activation
    rounding is q8_rows.c's, its integer sums and float steps too), at every row count."""
    from sglang_like_kernels import cpu as native_cpu

    codes, scales, _ = _q8_matrix(n, k, seed=n + k)
    packed, packed_scales = native_cpu.q8_x16_pack(codes, scales)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 8
    x[0, :32] = 0
    y = amx.q8_x16_matmul(x, packed, packed_scales)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert torch.equal(y, native_cpu.q8_x16_matmul(x, packed, packed_scales))
    strided = torch.zeros(m, 2 * k)
    strided[:, :k] = x
    assert torch.equal(amx.q8_x16_matmul(strided[:, :k], packed, packed_scales), y)


@pytest.mark.parametrize("invariant", [False, True])
def test_q8_head_runs_its_x16_rows_on_the_tiles_from_amx_min_rows(invariant, monkeypatch):
    """The default head on AMX is the x16 layout (it has the greedy argmax path): the x16
    kernel below `amx_min_rows` rows, the tiles from there, the same logits either way, one
    copy of the matrix; `batch_invariant` too (no kernel rounds otherwise)."""
    from sglang_like_kernels import cpu as native_cpu

    _, _, w = _q8_matrix(256, 576, seed=2)
    layer, method = nn.Module(), Q8HeadMethod(batch_invariant=invariant)
    method.create_weights(layer, [w], torch.device("cpu"))
    assert layer.x16 and layer.x16_amx and not layer.amx and method.argmax_supported(layer)
    assert {name for name, _ in layer.named_buffers()} == {"weight", "block_scale",
                                                           "row_bounds"}
    calls = []
    for mod, tag in ((native_cpu, "x16"), (amx, "tiles")):
        real = mod.q8_x16_matmul
        monkeypatch.setattr(mod, "q8_x16_matmul",
                            lambda *a, _r=real, _t=tag: calls.append(_t) or _r(*a))
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(4))
    whole = method.apply(layer, x)
    for rows in (1, method.amx_min_rows - 1, method.amx_min_rows, 40):
        del calls[:]
        assert torch.equal(method.apply(layer, x[:rows]), whole[:rows])
        assert calls == ["tiles" if rows >= method.amx_min_rows else "x16"]
