"""The page manager and what it is built of, one concept per module:

- manager.py: the page tables of live requests over a page pool
  (`PagedKVCacheManager`): admission of tokens, prefix caching with salts,
  forks, sliding-window layer groups, the host tier, batch metadata.
- page_pool.py: page ids, reference counts and the prefix cache's hash table.
- page_tensors.py: the K/V tensors behind the page ids, one pool per layer.
- eviction.py: which cached page a new allocation takes.
- kv_events.py: cache events in vLLM's schema.

The cache layer runs no attention: it hands page tables to whoever does.
"""

from .manager import BatchMetadata, CacheStateError, OutOfPagesError, PagedKVCacheManager

__all__ = ["BatchMetadata", "CacheStateError", "OutOfPagesError", "PagedKVCacheManager"]
