"""``flashinfer.jit.attention.variants``: the CUDA declarations FlashInfer's
JIT variants are built from. pagedkv builds none: sinks are a run() argument
of its wrappers (pagedkv.attention_sinks), so the declarations are empty."""

from __future__ import annotations

attention_sink_decl = {"fa2": "", "fa3": ""}
"""FlashInfer's sink variant source per backend (empty here)."""
