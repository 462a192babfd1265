"""NumPy arrays and torch tensors as MAX buffers, without copies.

Every public function takes either kind; outputs are allocated with the kind
and device of the inputs. Caches are wrapped in place (`Buffer.from_numpy` /
`Buffer.from_dlpack` share memory), so an op that writes a cache writes the
caller's array.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from max.driver import Buffer
from max.dtype import DType
from max.graph import DeviceRef

from .contract import FP8_FORMATS

Array = Any
"""A numpy.ndarray or a torch.Tensor."""


@dataclass(frozen=True)
class Device:
    """Where an array lives: ("cpu", 0) or ("gpu", index)."""

    kind: str
    index: int = 0

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    def graph_ref(self) -> DeviceRef:
        return DeviceRef.GPU(self.index) if self.is_gpu else DeviceRef.CPU()

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}" if self.is_gpu else "cpu"


CPU = Device("cpu")


def is_torch(x: Array) -> bool:
    return type(x).__module__.startswith("torch")


def check_array(name: str, x: Array) -> None:
    """Raises TypeError unless x is a numpy array or a torch tensor."""
    if not (isinstance(x, np.ndarray) or is_torch(x)):
        raise TypeError(f"{name} must be a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")


_TORCH_DTYPES: dict[Any, DType] = {}
"""torch dtype -> DType, filled as dtypes are met: run() asks several times
per call, and a lookup is cheaper than parsing the name."""


def dtype_of(x: Array) -> DType:
    if is_torch(x):
        dtype = _TORCH_DTYPES.get(x.dtype)
        if dtype is None:
            dtype = _TORCH_DTYPES[x.dtype] = DType[str(x.dtype).removeprefix("torch.")]
        return dtype
    return DType.from_numpy(x.dtype)


def device_of(x: Array) -> Device:
    if not is_torch(x) or x.is_cpu:
        return CPU
    if x.is_cuda:
        return Device("gpu", x.device.index or 0)
    raise ValueError(f"unsupported torch device {x.device}")


def is_contiguous(x: Array) -> bool:
    if is_torch(x):
        return x.is_contiguous()
    return x.flags.c_contiguous


def contiguous(x: Array) -> Array:
    """x itself when it is already C-contiguous, else a contiguous copy."""
    if is_contiguous(x):
        return x
    return x.contiguous() if is_torch(x) else np.ascontiguousarray(x)


def to_buffer(x: Array, *, stream_ordered: bool = False) -> Buffer:
    """A MAX buffer sharing x's memory (x must be contiguous); a Buffer as is.

    stream_ordered: the caller executes the buffer's op inside
    `_kernels.stream_ordered`, which already orders MAX's stream after
    torch's. A CUDA tensor is then exported as a bare DLPack capsule, skipping
    the stream handshake of torch's `__dlpack__` that this ordering makes
    redundant and costs most of a tensor's export, three or four tensors
    per decode call (docs/design.md, "Kernel notes"). Without it, a CUDA
    tensor goes through `Buffer.from_dlpack`.

    Not cached: a MAX buffer holds a reference to its array's memory, so a
    cache of buffers would keep every array it ever saw alive (torch keeps
    a tensor's Python object alive while its memory is exported, so not even
    a weak reference would let go).
    """
    if isinstance(x, Buffer):
        return x
    if not is_torch(x):
        return Buffer.from_numpy(x)
    if x.is_cpu or stream_ordered:
        if not x.is_contiguous():
            raise ValueError("a torch tensor passed to a kernel must be contiguous")
        # torch's __dlpack__ and MAX's from_dlpack wrap the export in layers
        # of Python checks, which the bare capsule skips (several times
        # cheaper, cold or warm: docs/design.md, "Kernel notes").
        return Buffer._from_dlpack(_Capsule(torch_to_dlpack(x), _dlpack_device(x)))
    return Buffer.from_dlpack(x)


def _dlpack_device(x: Array) -> tuple[int, int]:
    """x's (DLPack device type, index): kDLCPU is 1, kDLCUDA 2."""
    return (1, 0) if x.is_cpu else (2, x.device.index or 0)


class _Capsule:
    """A DLPack capsule, as the DLPack protocol presents one."""

    __slots__ = ("capsule", "device")

    def __init__(self, capsule: Any, device: tuple[int, int]) -> None:
        self.capsule = capsule
        self.device = device

    def __dlpack__(self, **_: Any) -> Any:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


def torch_to_dlpack(x: Array) -> Any:
    """torch.utils.dlpack.to_dlpack(x), imported on first use (torch is optional)."""
    global _to_dlpack
    if _to_dlpack is None:
        from torch.utils.dlpack import to_dlpack as _to_dlpack
    return _to_dlpack(x)


_to_dlpack: Any = None


def storage_view(x: Array) -> Array:
    """x itself, or for an fp8 tensor its bytes as uint8: MAX has no fp8
    tensors on the CPU, so fp8 pools cross into the graph as bytes."""
    if is_torch(x) and dtype_of(x) in FP8_FORMATS:
        import torch

        return x.view(torch.uint8)
    return x


def storage_dtype(dtype: DType) -> DType:
    return DType.uint8 if dtype in FP8_FORMATS else dtype


def empty(like: Array, shape: Sequence[int], dtype: DType) -> Array:
    """An uninitialised array of the kind and device of `like`."""
    if is_torch(like):
        import torch

        return torch.empty(tuple(shape), dtype=getattr(torch, dtype.name), device=like.device)
    return np.empty(tuple(shape), dtype=dtype.to_numpy())


def empty_like(x: Array) -> Array:
    """An uninitialised contiguous array of x's shape, dtype and device.

    For torch, `empty_like` is cheaper than `empty` with a shape, dtype and
    device once a step has evicted torch's dispatch code (docs/design.md,
    "Kernel notes").
    """
    if is_torch(x):
        import torch

        return torch.empty_like(x, memory_format=torch.contiguous_format)
    return np.empty(x.shape, x.dtype)


def to_host_numpy(x: Array) -> np.ndarray:
    """The values of x as a NumPy array (a device-to-host copy for GPU tensors)."""
    if is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def new_like(like: Array, values: np.ndarray) -> Array:
    """values (a host NumPy array) as an array of like's kind and device."""
    if is_torch(like):
        import torch

        return torch.from_numpy(values).to(like.device)
    return values


def write_front(buffer: Array, values: np.ndarray) -> Array:
    """Copies values (host NumPy) into the front of buffer, in place (a torch
    tensor on any device, or a NumPy array); returns that front, a view."""
    view = buffer[: len(values)]
    if is_torch(buffer):
        import torch

        view.copy_(torch.from_numpy(np.ascontiguousarray(values)))  # converts the dtype
    else:
        view[:] = values
    return view


def accelerator(device: Device) -> Any:
    """MAX's driver device for a GPU `device`."""
    from max.driver import Accelerator

    return Accelerator(device.index)
