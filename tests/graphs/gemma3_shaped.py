"""The small random model with Gemma 3's block that test_model_families.py
runs, and its engine: shared with warm_graphs.py, which compiles its step
graphs ahead.

The windows are short (12 tokens over 4-token pages) so that a few dozen
tokens release pages in the window group, which the reference never has.
"""

from __future__ import annotations

import math

from pagedkv.cache.manager import PagedKVCacheManager
from pagedkv.graphs.engine import DecoderEngine
from pagedkv.graphs.model import DecoderConfig

PAGE = 4
WINDOW = 12
CONFIG = DecoderConfig(
    vocab_size=512,
    hidden_size=128,
    num_layers=3,
    num_qo_heads=4,
    num_kv_heads=1,
    head_dim=64,
    ffn_size=256,
    rope_theta=1e6,
    rms_eps=1e-6,
    max_positions=256,
    family="gemma3",
    activation="gelu_tanh",
    qk_norm=True,
    sandwich_norms=True,
    norm_in_float32=True,
    embed_scale=math.sqrt(128),
    windows=(WINDOW, None, WINDOW),
    local_rope_theta=1e4,
)
WEIGHTS_SEED = 7


def engine(
    weights, num_pages: int, quantized: dict | None = None, kv_dtype: str = "float32"
) -> DecoderEngine:
    """A `DecoderEngine` of CONFIG over a fresh pool of num_pages pages."""
    manager = PagedKVCacheManager(
        num_pages,
        PAGE,
        CONFIG.num_kv_heads,
        CONFIG.head_dim,
        num_layers=CONFIG.num_layers,
        layer_groups=CONFIG.layer_groups,
        dtype=kv_dtype,
    )
    return DecoderEngine(CONFIG, weights, manager, quantized=quantized)
