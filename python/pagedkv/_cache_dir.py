"""pagedkv's cache directory: compiled kernels and graphs, fetched models."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$PAGEDKV_CACHE_DIR, else $XDG_CACHE_HOME/pagedkv, else ~/.cache/pagedkv."""
    if os.environ.get("PAGEDKV_CACHE_DIR"):
        return Path(os.environ["PAGEDKV_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedkv"
