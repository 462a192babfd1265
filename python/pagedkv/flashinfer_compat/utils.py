"""``flashinfer.utils``: the device queries FlashInfer's code and tests ask.

pagedkv's CPU and generic GPU kernels play the part of FlashInfer's FA2
kernels, which need sm_80: get_compute_capability answers (8, 0) for a
device that is not a CUDA GPU, so code gated on a capability takes the FA2
path. A CUDA device answers its own.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

from .._plan.block_tables import multi_ctas_kv_counter_bytes, sm_count
from ..nvfp4 import FP4Tensor as FP4Tensor  # FlashInfer keeps it in utils

FA2_CAPABILITY = (8, 0)


class PosEncodingMode(Enum):
    NONE = 0
    ROPE_LLAMA = 1
    ALIBI = 2


class TensorLayout(Enum):
    NHD = 0
    HND = 1


class GPUArchitectureError(Exception):
    """Raised by FlashInfer where a kernel needs another GPU generation."""


class BackendSupportedError(Exception):
    """Raised by FlashInfer for a backend a configuration does not support."""


def get_compute_capability(device: Any) -> tuple[int, int]:
    """(major, minor) of a CUDA device; FA2_CAPABILITY for any other."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_capability(device)
    return FA2_CAPABILITY


def _is_arch(device: Any, major: int) -> bool:
    return get_compute_capability(device)[0] == major


def is_sm90a_supported(device: Any) -> bool:
    return _is_arch(device, 9)


def is_sm100a_supported(device: Any) -> bool:
    return _is_arch(device, 10)


def is_sm110a_supported(device: Any) -> bool:
    return _is_arch(device, 11)


def is_sm120a_supported(device: Any) -> bool:
    return _is_arch(device, 12)


def is_sm12x_supported(device: Any) -> bool:
    return _is_arch(device, 12)


def get_device_sm_count(device: Any) -> int:
    """A CUDA device's SM count; 1 for any other (pagedkv's block-table calls
    size FlashInfer's multi-CTA counter buffers by the same answer)."""
    return sm_count(device)


def get_trtllm_gen_multi_ctas_kv_counter_bytes(
    batch_size: int, num_qo_heads: int, sm_count: int
) -> int:
    """Bytes of FlashInfer's trtllm-gen multi-CTA KV counters."""
    return multi_ctas_kv_counter_bytes(batch_size, num_qo_heads, sm_count)


def is_fa3_backend_supported(*args: Any, **kwargs: Any) -> bool:
    """pagedkv has no FA3 kernel."""
    return False


def is_fa3_prefill_head_dim_supported(head_dim_qk: int, head_dim_vo: int) -> bool:
    return False


def has_flashinfer_jit_cache() -> bool:
    """True: there is nothing to JIT-compile ahead of a call (pagedkv compiles
    its ops on first use), so warm-up hooks keyed on this are skipped."""
    return True


def ceil_div(x: int, y: int) -> int:
    return -(-x // y)


def round_up(x: int, y: int) -> int:
    return ceil_div(x, y) * y


def next_positive_power_of_2(x: int) -> int:
    return 1 if x < 1 else 1 << math.ceil(math.log2(x))


def device_support_pdl(device: Any) -> bool:
    """Whether programmatic dependent launch applies: never here (a CUDA
    launch option the CPU and MAX's launches do not take)."""
    return False
