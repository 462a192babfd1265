"""Compiled MAX models kept on disk, named by what built them.

MAX's own disk cache finds a compile only after the graph is built and
hashed (about a second for a graph naming pagedkv's kernels, and as long
again to check the cache); a compiled artifact (MAX's .mef) that pagedkv
names itself loads in milliseconds with no graph built at all. So each
compile pagedkv does (an eager op's one-op graph, the suite's module of
ops, a model's step graphs) is exported once and loaded by name after.

The name covers everything the artifact depends on:
- the build: MAX's and Mojo's versions and every pagedkv source file (the
  kernels and the Python that builds graphs), so an edit or an upgrade
  compiles afresh instead of loading a stale artifact;
- the host: the CPU's architecture and features (and the virtual CPU target
  the kernels are compiled for, if one is set), or the GPU's architecture;
- the caller's key: what the graphs are (op specs, model shape, dtype).

Artifacts live in <cache_root()>/compiled/<build>/. PAGEDKV_COMPILE_CACHE=0
turns the cache off; MAX's virtual devices (compiling for a GPU this machine
lacks) never use it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any

from .cpu_target import apply_cpu_target
from .paths import cache_root, mojo_ops_path
from .tensors import Device, accelerator


def enabled() -> bool:
    """Whether compiles are exported and loaded by name (see the module doc)."""
    if os.environ.get("PAGEDKV_COMPILE_CACHE", "1") in ("0", "false", "no"):
        return False
    import max.driver

    return not max.driver.is_virtual_device_mode()


@functools.cache
def build_digest() -> str:
    """A digest of MAX's and Mojo's versions and of pagedkv's sources."""
    from importlib.metadata import version

    digest = hashlib.sha256()
    for dist in ("max", "mojo-compiler"):
        digest.update(f"{dist}=={version(dist)}\n".encode())
    package = Path(__file__).resolve().parents[1]
    from .. import graphs

    roots = {package, mojo_ops_path(), Path(graphs.__file__).resolve().parent}
    for root in sorted(roots):
        for path in sorted([*root.rglob("*.py"), *root.rglob("*.mojo")]):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


@functools.cache
def host_digest(device: Device) -> str:
    """What a compile for `device` on this host depends on: the CPU's
    architecture and features (and the virtual CPU target the kernels are
    compiled for instead, if one is set: cpu_target.py), and a GPU's
    architecture."""
    parts = [platform.machine(), platform.system(), apply_cpu_target()]
    try:
        with open("/proc/cpuinfo") as f:
            parts += sorted({line for line in f if line.startswith(("flags", "Features"))})
    except OSError:
        parts.append(platform.processor())
    if device.is_gpu:
        gpu = accelerator(device)
        parts += [gpu.api, gpu.architecture_name]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def artifact_path(key: Hashable, device: Device) -> Path:
    """Where the artifact for `key` on `device` lives (it may not exist yet)."""
    name = hashlib.sha256(repr((key, host_digest(device))).encode()).hexdigest()[:32]
    return artifact_dir() / f"{name}.mef"


def artifact_dir() -> Path:
    """The folder of this build's artifacts (those of other builds, in the
    folders beside it, are never read by this one)."""
    return cache_root() / "compiled" / build_digest()


def load_or_compile(
    session: Any,
    key: Hashable,
    device: Device,
    build: Callable[[], Any],
    custom_extensions: list,
    weights_registry: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The models of the module `build()` returns, by graph name: loaded
    from the artifact named by `key` when there is one, else compiled,
    exported under that name, and initialized.

    Args:
        session: the `InferenceSession` to load into.
        key: what the module's graphs are (with its repr stable across
            processes: tuples of strings, numbers and dataclasses).
        device: the device the graphs run on (part of the name).
        build: makes the Module (or Graph); called only on a miss.
        custom_extensions: the kernel packages the graphs name.
        weights_registry: the graphs' weights, by name.

    Returns:
        The loaded models keyed by graph name.
    """
    if not enabled():
        return session.load_all(
            build(), custom_extensions=custom_extensions, weights_registry=weights_registry
        )
    path = artifact_path(key, device)
    if path.is_file():
        try:
            return session.load_all(path, weights_registry=weights_registry)
        except Exception:  # noqa: BLE001  (a truncated or stale artifact: compile again)
            pass
    compiled = compile_to_disk(session, key, device, build, custom_extensions)
    return session.init_all(compiled, weights_registry=weights_registry)


def compile_to_disk(
    session: Any,
    key: Hashable,
    device: Device,
    build: Callable[[], Any],
    custom_extensions: list,
) -> Any:
    """Compiles the module `build()` returns and exports it under `key`
    (when the cache is enabled); returns MAX's CompiledModel."""
    compiled = session.compile(build(), custom_extensions=custom_extensions)
    if not enabled():
        return compiled
    path = artifact_path(key, device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}.partial")
        compiled.export_mef(staging)
        os.replace(staging, path)  # whole or absent, whatever runs beside
    except OSError:
        pass  # a read-only cache still serves this process
    return compiled
