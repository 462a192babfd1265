"""``flashinfer.jit.env``: where FlashInfer's CUDA sources would be. pagedkv
ships none; the paths exist for code that builds them (and fails there)."""

from pathlib import Path

FLASHINFER_CSRC_DIR = Path(__file__).resolve().parent / "csrc-not-shipped"
FLASHINFER_INCLUDE_DIR = FLASHINFER_CSRC_DIR
FLASHINFER_JIT_DIR = FLASHINFER_CSRC_DIR
