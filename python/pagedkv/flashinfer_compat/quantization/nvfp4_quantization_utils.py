"""The NVFP4 constants FlashInfer's helpers import; no NVFP4 kernels here."""

from __future__ import annotations

from enum import Enum

nvfp4_e4m3_max = 448.0
"""Largest e4m3 value: the range of an NVFP4 block scale."""


class NVFP44Over6ErrMode(Enum):
    MSE = 0
    MAX = 1


class NVFP44Over6Config:
    """Placeholder for FlashInfer's 4-over-6 NVFP4 rounding options."""
