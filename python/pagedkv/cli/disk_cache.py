"""`pagedkv cache`: what pagedkv keeps on disk, and removing what this
version of pagedkv will never read again.

The cache directory (`cache_root()`: $PAGEDKV_CACHE_DIR, else
$XDG_CACHE_HOME/pagedkv, else ~/.cache/pagedkv) holds, by kind:

- models: downloaded GGUFs, each with its unpacked copy beside it;
- compiled graphs: `compiled/<build>/`, one folder per build of pagedkv
  (its sources, MAX's and Mojo's versions, `compile_cache.py`);
- kernel packages: `<hash>/mojo_ops.mojoc`, one per version of the Mojo
  sources;
- RoPE tables: `rope/<hash>/`, one folder per version of their formula;
- unpacked GGUFs: copies of GGUFs kept outside the cache directory;
- leftovers: what a process stopped mid-write left (staging files and
  folders) an hour or more ago.

An entry is stale when this version never reads it: another build's
compiled graphs, kernel package or RoPE tables, an unpacked copy whose GGUF
is gone or changed, a leftover. A process of another pagedkv version
sharing the directory compiles again what `--prune` took from it; nothing
reads a file half-removed (each reader falls back to making it afresh).
Downloaded models are never stale.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

LEFTOVER_AGE_S = 3600
"""A staging file or folder younger than this may still be written."""


@dataclass(frozen=True)
class CacheEntry:
    """One file or folder of the cache directory, of one kind."""

    kind: str
    path: Path
    bytes: int
    stale: bool


def cache_entries() -> list[CacheEntry]:
    """Every entry of the cache directory by kind, stale or not (see the
    module docstring); empty where there is no cache directory.

    Examples
    --------
    >>> import os, tempfile
    >>> from pagedkv.cli.disk_cache import cache_entries
    >>> os.environ["PAGEDKV_CACHE_DIR"] = tempfile.mkdtemp()
    >>> cache_entries()
    []
    """
    from .._ops.compile_cache import artifact_dir
    from .._ops.kernels import KERNEL_PACKAGE_NAME, kernel_package_path
    from .._ops.paths import cache_root
    from ..graphs.decoder import rope_dir
    from ..models import unpacked

    root = cache_root()
    if not root.is_dir():
        return []
    leftovers = _leftovers(root)
    stale_unpacked = set(unpacked.stale_copies())
    kinds = {
        "models": [p for p in root.glob("models/**/*.gguf") if p.is_file()],
        "compiled graphs": list(root.glob("compiled/*")),
        "kernel packages": [p.parent for p in root.glob(f"*/{KERNEL_PACKAGE_NAME}")],
        "RoPE tables": list(root.glob("rope/*")),
        "unpacked GGUFs": [folder for folder, _ in unpacked.copies()],
    }
    current = {artifact_dir(), kernel_package_path().parent, rope_dir()}
    entries = [
        CacheEntry(kind, path, _size(path), _is_stale(kind, path, current, stale_unpacked))
        for kind, paths in kinds.items()
        for path in sorted(paths)
        if path not in leftovers
    ]
    return entries + [CacheEntry("leftovers", p, _size(p), True) for p in sorted(leftovers)]


def _is_stale(kind: str, path: Path, current: set[Path], stale_unpacked: set[Path]) -> bool:
    if kind == "models":
        return False
    if kind == "unpacked GGUFs":
        return path in stale_unpacked
    return path not in current


def _leftovers(root: Path) -> set[Path]:
    """Staging files and folders (`compile_cache`'s and `unpacked`'s
    `.partial`, `kernels`' `.staging.`, `kept_array`'s hidden files, a
    download's `tmp` folder) untouched for LEFTOVER_AGE_S."""
    found = {
        *root.glob("**/*.partial"),
        *root.glob("*/.staging.*"),
        *root.glob("rope/.*"),
        *root.glob("rope/*/.*"),
        *root.glob("**/.*.panels.npy.*"),
        *root.glob("models/*/tmp*"),
    }
    old = time.time() - LEFTOVER_AGE_S
    return {p for p in found if _mtime(p) < old}


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()  # gone already: not a leftover to remove


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(folder) / name).stat().st_size
            except OSError:
                pass  # removed while counted
    return total


def prune(entries: list[CacheEntry]) -> int:
    """Removes the stale entries; returns the bytes they held."""
    removed = 0
    for entry in entries:
        if not entry.stale:
            continue
        if entry.path.is_dir():
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            entry.path.unlink(missing_ok=True)
        removed += entry.bytes
    return removed


def add_parser(sub) -> None:
    """`pagedkv cache`'s flags."""
    cache = sub.add_parser(
        "cache", help="what pagedkv keeps on disk; --prune removes what it no longer reads"
    )
    cache.add_argument(
        "--prune",
        action="store_true",
        help="remove the stale entries (other builds' compiles, copies of GGUFs that are gone)",
    )


def run_cache(args: argparse.Namespace) -> int:
    """Prints the cache directory's entries by kind, and prunes them with --prune."""
    from .._ops.paths import cache_root

    entries = cache_entries()
    print(f"pagedkv's cache directory: {cache_root()}")
    print(f"{'kind':<17} {'entries':>7} {'MB':>9} {'stale':>6} {'stale MB':>9}")
    for kind in dict.fromkeys(e.kind for e in entries):
        of = [e for e in entries if e.kind == kind]
        stale = [e for e in of if e.stale]
        print(
            f"{kind:<17} {len(of):>7} {_mb(of):>9.1f} {len(stale):>6} {_mb(stale):>9.1f}",
        )
    stale = [e for e in entries if e.stale]
    if args.prune:
        print(f"removed {len(stale)} stale entries, {prune(entries) / 1e6:.1f} MB")
    elif stale:
        print(f"`pagedkv cache --prune` removes the {len(stale)} stale entries")
    return 0


def _mb(entries: list[CacheEntry]) -> float:
    return sum(e.bytes for e in entries) / 1e6
