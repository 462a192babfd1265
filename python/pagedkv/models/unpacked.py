"""A GGUF read once and kept unpacked: the packed quantized matrices and
the float32 weights a quantized graph reads (norms, an embedding in a
format left unpacked, products left float) as .npy files and the metadata
as JSON, in the cache directory (beside the GGUF when it is there). The
float32 weights of the packed matrices (what the float forms multiply) are
dequantized from the GGUF itself on first use: kept here they would be 7x
the file.

Reading the GGUF costs seconds (the `gguf` reader parses every tokenizer
string one at a time; dequantizing and packing are the rest); the unpacked
copy loads in milliseconds (the weights are memory-mapped, read-only, and
MAX takes them as they are: they stay in the page cache, shared by every
process serving the file). Each packed matrix's layers lie one after
another in one file, so the weights a run of layers' op takes stacked are
a slice of the mapping, not a copy. The copy is named by the GGUF's size
and modification time and by the source of the reader, the packer and this
module, so a new file or a fix to any of them unpacks afresh.
A missing, partial or unreadable copy is never used: the GGUF is read again
and the copy rewritten.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from pagedkv._ops import quantized_panels
from pagedkv._ops.quantized_panels import QuantizedWeight, quantized_panels_shape
from pagedkv.graphs.decoder import packed_float_names
from pagedkv.graphs.model import DecoderConfig

from . import gguf_model
from .fetch import cache_dir
from .gguf_model import GGUFModel, LazyWeights, read_float_weights, read_gguf

_DONE = "model.json"
"""Written last: a folder without it is partial."""
_SOURCE = "source"
"""The GGUF's absolute path, so that a copy whose GGUF is gone can be told."""
_LAYER = re.compile(r"^layers\.\d+\.")
"""A layer's prefix of a weight's name."""


def unpacked_dir(path: Path) -> Path:
    """The folder holding `path`'s unpacked copy (it may not exist yet):
    beside a GGUF in the cache directory; for a GGUF elsewhere, in the cache
    directory's `unpacked/`, named by its absolute path, so that nothing is
    written beside a user's own file."""
    path = path.resolve()
    stat = path.stat()
    digest = hashlib.sha256()
    for source in (gguf_model.__file__, quantized_panels.__file__, __file__):
        digest.update(Path(source).read_bytes())
    key = f"{stat.st_size}-{stat.st_mtime_ns}-{digest.hexdigest()[:12]}"
    cache = cache_dir().resolve()
    if path.is_relative_to(cache):
        return path.parent / f"{path.stem}.unpacked" / key
    where = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    return cache / "unpacked" / f"{path.stem}-{where}" / key


def copies() -> list[tuple[Path, Path | None]]:
    """Every unpacked copy in the cache directory (those being written,
    `.partial`, left out), each with the GGUF it was made from (None: a copy
    in `unpacked/` that does not name it, made by an older version)."""
    cache = cache_dir()
    found = [(f, _named_source(f)) for f in cache.glob("unpacked/*/*")]
    # A copy beside a GGUF in the cache directory is named after it.
    found += [(f, f.parent.with_suffix(".gguf")) for f in cache.glob("models/**/*.unpacked/*")]
    return [(folder, gguf) for folder, gguf in found if not folder.name.endswith(".partial")]


def stale_copies() -> list[Path]:
    """The unpacked copies that no read will use again: their GGUF is gone,
    changed or unknown, or another version of the reader made them (their
    folder is not `unpacked_dir` of their GGUF)."""
    return [
        folder
        for folder, gguf in copies()
        if gguf is None or not gguf.is_file() or unpacked_dir(gguf) != folder.resolve()
    ]


def _named_source(folder: Path) -> Path | None:
    try:
        return Path((folder / _SOURCE).read_text())
    except OSError:
        return None


def read_unpacked(path: str | Path) -> GGUFModel:
    """The model in the GGUF at `path`, from its unpacked copy (made on first
    use; see the module docstring). Raises ModelError as `read_gguf` does."""
    path = Path(path)
    folder = unpacked_dir(path)
    if (folder / _DONE).is_file():
        try:
            return _load(folder, path)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: read the GGUF again below
    model = read_gguf(path)
    try:
        _save(model, folder, path.resolve())
    except OSError:
        pass  # a read-only cache still serves this process
    return model


def _save(model: GGUFModel, folder: Path, source: Path) -> None:
    shutil.rmtree(folder.parent, ignore_errors=True)  # older copies of this GGUF
    staging = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    staging.mkdir(parents=True, exist_ok=True)
    (staging / _SOURCE).write_text(str(source))
    packed = packed_float_names(model.quantized)
    stored = {name: i for i, name in enumerate(n for n in model.weights if n not in packed)}
    for name, i in stored.items():
        np.save(staging / f"{i}.npy", model.weights[name])
    where = _save_panels(model.quantized, staging)
    record = {
        "config": dataclasses.asdict(model.config),
        # Each weight's .npy index, or None: dequantized from the GGUF.
        "weights": [[name, stored.get(name)] for name in model.weights],
        "quantized": [
            [name, q.format, q.out_features, q.in_features, *where[id(q)]]
            for name, q in model.quantized.items()
        ],
        "metadata": model.metadata,
    }
    (staging / _DONE).write_text(json.dumps(record, default=_plain))
    os.replace(staging, folder)


def _save_panels(quantized: dict[str, QuantizedWeight], staging: Path) -> dict[int, tuple]:
    """Each distinct packed matrix (a tied embedding is its head) into a
    file `q{file}.npy` shared by the matrices of one name, format and shape
    in every layer, stacked in layer order: a run of layers' matrices is
    then one slice of the file, which the step graph takes as it is
    (`graphs.decoder`'s `_stack_runs`). Returns, by id, (file, first panel)."""
    stacks: dict[tuple, list[QuantizedWeight]] = {}
    seen: set[int] = set()
    for name, q in quantized.items():
        if id(q) not in seen:
            seen.add(id(q))
            key = (_LAYER.sub("", name), q.format, q.out_features, q.in_features)
            stacks.setdefault(key, []).append(q)
    where = {}
    for file, stack in enumerate(stacks.values()):
        np.save(staging / f"q{file}.npy", np.concatenate([q.panels for q in stack]))
        offsets = np.cumsum([0] + [len(q.panels) for q in stack])
        where |= {id(q): (file, int(start)) for q, start in zip(stack, offsets[:-1], strict=True)}
    return where


def _load(folder: Path, path: Path) -> GGUFModel:
    record = json.loads((folder / _DONE).read_text())
    gguf_weights = functools.cache(lambda: read_float_weights(path))

    def maker(name: str, i: int | None):
        if i is None:
            return lambda: gguf_weights()[name]
        array = np.load(folder / f"{i}.npy", mmap_mode="r")
        return lambda: array

    weights = LazyWeights({name: maker(name, i) for name, i in record["weights"]})
    files = functools.cache(lambda i: np.load(folder / f"q{i}.npy", mmap_mode="r"))
    by_place: dict[tuple[int, int], QuantizedWeight] = {}
    for _, fmt, n, k, i, start in record["quantized"]:
        if (i, start) not in by_place:
            panels = files(i)[start : start + quantized_panels_shape(fmt, n, k)[0]]
            by_place[i, start] = QuantizedWeight(fmt, n, k, panels)
    quantized = {name: by_place[i, start] for name, *_, i, start in record["quantized"]}
    return GGUFModel(DecoderConfig(**record["config"]), weights, record["metadata"], quantized)


def _plain(value: object) -> object:
    """NumPy scalars and arrays in the metadata as JSON values."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot store {type(value).__name__} in the model's metadata")
