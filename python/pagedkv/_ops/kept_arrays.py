"""Arrays derived once and kept on disk as .npy files: later loads map them
read-only instead of computing them again, and every process that maps one
shares its pages (MAX takes a memory-mapped weight without copying it)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np


def kept_array(
    path: Path, shape: tuple[int, ...], dtype: np.dtype, make: Callable[[], np.ndarray]
) -> np.ndarray:
    """The array in the .npy file `path`, memory-mapped read-only, where the
    file holds one of `shape` and `dtype`; else `make()`'s array, saved there
    first (the file appears whole or not at all) and mapped. Where the file
    cannot be written (a read-only cache), `make()`'s array itself.

    Examples
    --------
    >>> import tempfile, numpy as np
    >>> from pathlib import Path
    >>> from pagedkv._ops.kept_arrays import kept_array
    >>> path = Path(tempfile.mkdtemp()) / "ones.npy"
    >>> kept_array(path, (2,), np.dtype(np.float32), lambda: np.ones(2, np.float32))
    memmap([1., 1.], dtype=float32)
    """
    if path.is_file():
        try:
            kept = np.load(path, mmap_mode="r")
            if kept.shape == tuple(shape) and kept.dtype == dtype:
                return kept
        except (OSError, ValueError):
            pass  # unreadable: made and written again below
    made = make()
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(staging, "wb") as f:  # a path would get ".npy" appended
            np.save(f, made)
        os.replace(staging, path)
    except OSError:
        staging.unlink(missing_ok=True)
        return made
    return np.load(path, mmap_mode="r")
