"""A CUDA profile on CPU tensors: the runtime takes its CUDA control flow, and every
device-to-host sync it would make on a GPU is counted.

How: tensors the runtime places on "cuda" (a factory call with `device="cuda"`, a `.to` /
`.cuda()` of a host tensor) are CPU tensors of the subclass `DeviceTensor`, which answers
`device` -> cuda and `is_cuda` -> True, and whose results (anything computed from one) are
`DeviceTensor`s again (torch's subclass propagation through `__torch_function__`). So every
`device.type == "cuda"` / `is_cuda` test in the runtime and the kernels' dispatch sees CUDA,
while the arithmetic runs on the CPU.

A sync is counted where a GPU would make the host wait on the device: a `DeviceTensor` read
into Python or copied to the host (`cpu`, `to("cpu")`, `tolist`, `item`, `numpy`, `bool` /
`int` / `float` / `index`, printing) or an op whose output shape depends on its values
(`nonzero`, `masked_select`, `unique`, indexing with a boolean tensor). Host-to-device copies
are not syncs (pinned copies are asynchronous; `pin_memory` is a no-op here), but each is
recorded in `uploads` (a copy from pageable memory waits for the stream on a GPU, and every
copy costs a launch). This counts
at the Python API, which is where the runtime's syncs come from; it cannot see a sync hidden
inside a C++ op, which none of the ops above are known to have.

A Triton op (the kernels package's `triton_ops`, counted by name in `triton_calls`) runs its
launcher's host code on the DeviceTensors, so what it reads on the host is counted, with
every kernel launch a no-op; then the torch reference computes its result on the plain
tensors. The torch reference and the native CPU kernels called directly are counted in
`reference_calls` / `native_calls` (a dispatch test asserts they stay empty).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import sglang_like_kernels
import sglang_like_kernels.cpu.ops
from sglang_like_kernels import reference

CUDA = torch.device("cuda")
_SYNC_METHODS = frozenset({
    "cpu", "tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__",
    "__repr__", "__format__", "nonzero", "masked_select", "unique", "unique_consecutive",
})
_DEVICE_PROP = torch.Tensor.device
_IS_CUDA_PROP = torch.Tensor.is_cuda


class CudaProfile:
    """What a profiled run did: `syncs` (the method of each device-to-host sync, in order),
    and the kernels it launched."""

    def __init__(self) -> None:
        self.syncs: list[str] = []
        self.uploads: list[str] = []  # host-to-device copies: what made each
        self.triton_calls: collections.Counter[str] = collections.Counter()
        self.reference_calls: collections.Counter[str] = collections.Counter()
        self.native_calls: collections.Counter[str] = collections.Counter()
        self.num_paused = 0

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Syncs inside are not counted (a fake model's own reads, an invariant check)."""
        self.num_paused += 1
        try:
            yield
        finally:
            self.num_paused -= 1

    def reset(self) -> None:
        self.syncs.clear()
        self.uploads.clear()
        self.triton_calls.clear()
        self.reference_calls.clear()
        self.native_calls.clear()


_active: list[CudaProfile] = []


def _record_sync(name: str) -> None:
    if _active and not _active[-1].num_paused:
        _active[-1].syncs.append(name)


def _record_upload(name: str) -> None:
    if _active and not _active[-1].num_paused:
        _active[-1].uploads.append(name)


def _is_cuda(device: Any) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


def _is_host(device: Any) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"


def _plain(value: Any) -> Any:
    if isinstance(value, DeviceTensor):
        return value.as_subclass(torch.Tensor)
    return value


def to_device(value: Any) -> Any:
    """`value` (a tensor, or a tuple / list of them) as DeviceTensors."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DeviceTensor):
        return value.as_subclass(DeviceTensor)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v) for v in value)
    return value


class DeviceTensor(torch.Tensor):
    """A CPU tensor standing for one resident on the GPU."""

    @classmethod
    def __torch_function__(cls, func: Any, types_: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is _DEVICE_PROP:
            return CUDA
        if owner is _IS_CUDA_PROP:
            return True
        name = getattr(func, "__name__", "")
        if name == "pin_memory":
            return args[0]
        if name in ("to", "cuda"):
            return _move(func, args, kwargs)
        if name == "__setitem__" and isinstance(args[2], (torch.Tensor, list, tuple)) and (
                not isinstance(args[2], DeviceTensor)):
            _record_upload("__setitem__")  # host data written into a device tensor
        if name in _SYNC_METHODS or (name == "__getitem__" and _bool_index(args)):
            _record_sync(name)
            if name == "cpu":
                return _plain(args[0])
        return super().__torch_function__(func, types_, args, kwargs)


def _bool_index(args: tuple) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _move(func: Any, args: tuple, kwargs: dict) -> Any:
    """`Tensor.to` / `cuda` of a DeviceTensor: to the host is a sync (a plain tensor comes
    back), to cuda or to a dtype stays on the device."""
    self = args[0]
    targets = [a for a in (*args[1:], kwargs.get("device")) if a is not None]
    to_host = any(_is_host(t) for t in targets)
    rest = tuple(a for a in args[1:] if not isinstance(a, (str, torch.device)))
    kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking")}
    with torch._C.DisableTorchFunctionSubclass():
        out = (self.to(*rest, **kwargs) if func.__name__ == "to" and (rest or kwargs)
               else self)
    if to_host:
        _record_sync("to(cpu)")
        return _plain(out)
    return to_device(_plain(out))


class _FactoryMode(TorchFunctionMode):
    """Factory calls and host-to-device moves aimed at cuda make DeviceTensors on the CPU."""

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name == "pin_memory":
            return args[0]
        if name in ("to", "cuda") and args and isinstance(args[0], DeviceTensor):
            return func(*args, **kwargs)  # DeviceTensor's own rule (_move)
        on_cuda = _is_cuda(kwargs.get("device"))
        if on_cuda:
            kwargs["device"] = "cpu"
        if name in ("to", "cuda") and args and not isinstance(args[0], DeviceTensor):
            targets = [*args[1:], kwargs.get("device")]
            if name == "cuda" or any(_is_cuda(t) for t in targets):
                on_cuda = True
                args = (args[0], *("cpu" if _is_cuda(a) else a for a in args[1:]))
                if name == "cuda":
                    return to_device(args[0].clone())
        out = func(*args, **kwargs)
        if on_cuda and _is_upload(name, args):
            _record_upload(name)
        return to_device(out) if on_cuda else out


# factories that fill memory on the device itself (no host data crosses)
_DEVICE_FILLS = frozenset({"zeros", "ones", "full", "empty", "arange", "zeros_like",
                           "ones_like", "full_like", "empty_like", "rand", "randn", "randint",
                           "linspace", "eye"})


def _is_upload(name: str, args: tuple) -> bool:
    """Whether a call aimed at cuda copies host data there (`torch.tensor(list)`, a host
    tensor's `.to`), rather than filling device memory."""
    return name not in _DEVICE_FILLS


class _NoKernels:
    """Stands for `triton_kernels` in `triton_ops`: `tk.some_kernel[grid](...)` does nothing."""

    def __getattr__(self, name: str) -> Any:
        return _NoKernels()

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None


def _counting(calls: collections.Counter[str], name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def _as_triton(calls: collections.Counter[str], name: str, launcher: Any, ref: Any) -> Any:
    """A Triton op under the profile: the launcher's host code on the device tensors (its
    host reads counted, its launches no-ops), then the reference's result on plain tensors
    (whose own reads are not the kernel's syncs)."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        launcher(*args, **kwargs)
        plain_args = [_plain(a) for a in args]
        plain_kwargs = {k: _plain(v) for k, v in kwargs.items()}
        with torch._C.DisableTorchFunctionSubclass():
            out = ref(*plain_args, **plain_kwargs)
        return to_device(out)

    return wrapper


def _kernel_names() -> list[str]:
    return list(sglang_like_kernels.__all__)


@contextlib.contextmanager
def cuda_profile() -> Iterator[CudaProfile]:
    """Inside: "cuda" tensors are DeviceTensors, syncs and kernel launches are counted."""
    from sglang_like_kernels import triton_ops

    profile = CudaProfile()
    fake_triton = types.SimpleNamespace(**{
        n: _as_triton(profile.triton_calls, n, getattr(triton_ops, n), getattr(reference, n))
        for n in _kernel_names() if hasattr(triton_ops, n)})
    saved_tk = triton_ops.tk
    saved_triton = sglang_like_kernels._triton_ops
    saved_ref = {n: getattr(reference, n) for n in _kernel_names() if hasattr(reference, n)}
    native = sglang_like_kernels.cpu.ops
    saved_native = {n: f for n, f in vars(native).items()
                    if inspect.isfunction(f) and f.__module__ == native.__name__
                    and not n.startswith("_")}
    sglang_like_kernels._triton_ops = fake_triton
    triton_ops.tk = _NoKernels()
    for n, fn in saved_ref.items():
        setattr(reference, n, _counting(profile.reference_calls, n, fn))
    for n, fn in saved_native.items():
        setattr(native, n, _counting(profile.native_calls, n, fn))
    _active.append(profile)
    try:
        with _FactoryMode():
            yield profile
    finally:
        _active.pop()
        sglang_like_kernels._triton_ops = saved_triton
        triton_ops.tk = saved_tk
        for n, fn in saved_ref.items():
            setattr(reference, n, fn)
        for n, fn in saved_native.items():
            setattr(native, n, fn)
