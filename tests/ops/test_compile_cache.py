"""pagedkv's compile cache: a second process loads what the first compiled,
by name, and never a broken artifact.

Each check runs an op in fresh processes with their own cache directory; the
process that must load forbids compiling outright, so a miss fails instead
of silently compiling again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv._ops.compile_cache import artifact_path
from pagedkv._ops.kernels import kernel_package
from pagedkv._ops.tensors import CPU, Device

SEQ_LENS = """
import numpy as np, pagedkv
print(pagedkv.get_seq_lens(np.array([0, 2, 3], np.int32), np.array([4, 9], np.int32), 16))
"""

NO_COMPILE = """
import os, max.engine
compile = max.engine.InferenceSession.compile
def refuse(self, model, **kwargs):  # loading a .mef passes its path here
    if not isinstance(model, (str, os.PathLike)):
        raise AssertionError("compiled instead of loading")
    return compile(self, model, **kwargs)
max.engine.InferenceSession.compile = refuse
"""


def seeded(cache: Path) -> Path:
    """`cache` holding this process's Mojo kernel package (built once per
    source version, outside what these tests check): a fresh directory
    would otherwise build it again in every process, seconds each."""
    package = kernel_package().parent
    if not (cache / package.name).exists():
        shutil.copytree(package, cache / package.name)
    return cache


def run(code: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PAGEDKV_CACHE_DIR": str(seeded(cache))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def artifacts(cache: Path) -> list[Path]:
    return sorted((cache / "compiled").rglob("*.mef"))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[Path, str]:
    """A cache directory holding the op one process compiled, and what the
    process printed (each compile costs seconds: the tests share this one)."""
    cache = tmp_path_factory.mktemp("compiled_cache")
    first = run(SEQ_LENS, cache)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.split() == ["[20", "9]"]
    assert len(artifacts(cache)) == 1
    return cache, first.stdout


def test_a_second_process_loads_the_compiled_op_without_compiling(compiled):
    cache, printed = compiled
    second = run(NO_COMPILE + SEQ_LENS, cache)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout == printed


def test_a_broken_artifact_is_compiled_again(compiled, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(compiled[0], cache)
    (artifact,) = artifacts(cache)
    artifact.write_bytes(b"not a compiled model")
    again = run(SEQ_LENS, cache)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.split() == ["[20", "9]"]
    assert artifact.read_bytes() != b"not a compiled model"


def test_the_cache_can_be_turned_off(tmp_path):
    env = {**os.environ, "PAGEDKV_CACHE_DIR": str(seeded(tmp_path)), "PAGEDKV_COMPILE_CACHE": "0"}
    result = subprocess.run(
        [sys.executable, "-c", SEQ_LENS], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert artifacts(tmp_path) == []


def test_a_cache_directory_that_cannot_be_written_still_gets_the_kernels(tmp_path, monkeypatch):
    """Where the cache directory cannot be written (a file stands in its
    place), the kernel package is built for the process alone in a
    temporary folder instead of failing with an OSError."""
    from pagedkv._ops import kernels

    blocked = tmp_path / "cache"
    blocked.write_text("")
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(blocked))
    package = kernels.kernel_package.__wrapped__()  # as in a fresh process
    assert package.name == kernels.KERNEL_PACKAGE_NAME
    assert package.stat().st_size > 0
    assert not package.is_relative_to(blocked) and blocked.read_text() == ""
    shutil.rmtree(package.parent)


def test_artifact_names_tell_keys_and_devices_apart(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    names = {
        artifact_path(("ops", 1), CPU),
        artifact_path(("ops", 2), CPU),
        artifact_path(("ops", 1.0), CPU),
    }
    assert len(names) == 3
    assert all(p.parent.parent == tmp_path / "compiled" for p in names)


def test_gpu_artifacts_are_named_apart_from_cpu_ones():
    """A GPU's name needs a GPU; without one, a CPU key is all there is."""
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        pytest.skip("needs a CUDA GPU")
    assert artifact_path("k", CPU) != artifact_path("k", Device("gpu", 0))
