"""What two instances must agree on before one reads the other's pages."""

from __future__ import annotations

from ..cache.manager import PagedKVCacheManager


def page_layout(manager: PagedKVCacheManager, model_id: str) -> str:
    """The model and the pools' layout as one string: pages move between
    instances (a store, a NIXL read) only when both sides' strings agree.

    Examples
    --------
    >>> page_layout(PagedKVCacheManager(4, 16, 2, 8, num_layers=3), "demo")
    'demo|float32|NHD|16|2|8|3|[((0, 1, 2), None)]'
    """
    m = manager
    return (
        f"{model_id}|{m.dtype.name}|{m.kv_layout}|{m.page_size}|{m.num_kv_heads}|"
        f"{m.head_dim}|{m.num_layers}|{list(m.layer_groups)}"
    )
