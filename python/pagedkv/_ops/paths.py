"""Where pagedkv's files are: its cache directory (compiled kernels and
graphs, fetched models) and the Mojo kernel package."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$PAGEDKV_CACHE_DIR, else $XDG_CACHE_HOME/pagedkv, else ~/.cache/pagedkv."""
    if os.environ.get("PAGEDKV_CACHE_DIR"):
        return Path(os.environ["PAGEDKV_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedkv"


def mojo_ops_path() -> Path:
    """The Mojo kernel package: inside the installed package, or at the top
    of a source checkout (editable installs)."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "mojo_ops", package.parents[1] / "mojo_ops"):
        if (candidate / "__init__.mojo").is_file():
            return candidate
    raise RuntimeError(f"pagedkv: cannot find the mojo_ops kernel package near {package}")
