"""Runs FlashInfer's own attention tests against pagedkv on the CPU.

    python tools/run_flashinfer_tests.py /path/to/flashinfer [--files ...]

FLASHINFER is a FlashInfer git checkout at PINNED_COMMIT (or a bare clone
that holds it: the tests are taken with `git archive`). Its tests are
copied to a work directory with one change, the device: "cuda:0" / "cuda"
become "cpu", and `.to(0)` (device 0) `.to("cpu")`.
tools/flashinfer_conftest.py replaces FlashInfer's conftest files: it maps
`import flashinfer` to pagedkv.flashinfer_compat and keeps,
for each test function, a covering sample of its parameter grid (every
value of every parameter at least once). The summary counts passes and
failures per file and groups failures by message; failures that need CUDA
itself (streams, CUDA graphs) are counted apart; a file that fails to
import counts as one failure. Files written for one GPU generation are
answered with it (GENERATIONS). FlashInfer's test helpers import einops and
tvm_ffi: `pip install einops apache-tvm-ffi`. See docs/flashinfer.md.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PINNED_COMMIT = "a0a6b019b9b27d49d209f85d028a1ae5a9b347d7"
"""FlashInfer v0.6.17."""
LEGACY_COMMIT = "v0.1.6"
"""Its shared-prefix test exercises the older cascade API (begin_forward / forward)."""
LEGACY_TEST = "python/tests/test_shared_prefix_kernels.py"

FILES = (
    "test_page.py",
    "test_batch_decode_kernels.py",
    "test_batch_prefill_kernels.py",
    "test_single_prefill.py",
    "test_tensor_cores_decode.py",
    "test_non_contiguous_decode.py",
    "test_non_contiguous_prefill.py",
    "test_decode_prefill_lse.py",
    "test_shared_prefix_kernels.py",
    "test_logits_cap.py",
    "test_sliding_window.py",
    "test_alibi.py",
)
"""The issue's bar: pages, batch and single decode and prefill, tensor-core
and non-contiguous decode, LSE, cascade / shared prefix, logits cap, sliding
window and ALiBi (tests/attention/ at PINNED_COMMIT). DeepSeek's MLA tests
(test_deepseek_mla.py) run with --files and --memory-cap: one case's own
reference needs more memory than a small host has."""

GENERATIONS = {
    "test_trtllm_gen_attention_decode.py": (10, 0),
    "test_trtllm_gen_attention_prefill.py": (10, 0),
    "test_trtllm_gen_mla.py": (10, 0),
    "test_trtllm_gen_attention_decode_xqa.py": (9, 0),
    "test_xqa_batch_decode.py": (9, 0),
    "test_xqa_mla_batch_decode.py": (12, 0),
    "test_attention_sink.py": (9, 0),
}
"""Files written for one GPU generation, and the (major, minor) their
capability checks are answered with (trtllm-gen: SM100; XQA and FA3's sink
tests: SM90; XQA's MLA kernel: SM120), so that their API and numbers are
tested on the CPU rather than skipped. Every other file gets FlashInfer's FA2
generation, (8, 0)."""

DEVICE = re.compile(r"""(["'])cuda(:0)?\1""")
DEVICE_INDEX = re.compile(r"\.to\(0\)")
NEEDS_CUDA = re.compile(
    r"not compiled with CUDA|CUDA graph|torch\.cuda|cudaStream|CUDA driver"
    r"|Cannot access accelerator device|Expected a cuda device"
)
TOO_LARGE = re.compile(r"can't allocate memory|Unable to allocate")
"""A test whose own reference outgrows the --memory-cap (the tests are sized
for a GPU's memory): the cap turns the OOM killer into this error."""


def git(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True).stdout


def extract(repo: Path, commit: str, paths: list[str], dest: Path) -> None:
    """The files at `commit` (checked: a checkout must be at it)."""
    bare = git(repo, "rev-parse", "--is-bare-repository").strip() == b"true"
    if not bare:
        head = git(repo, "rev-parse", "HEAD").decode().strip()
        want = git(repo, "rev-parse", f"{commit}^{{commit}}").decode().strip()
        if head != want:
            sys.exit(f"{repo} is at {head}, not {want}: check out the pinned commit")
    data = git(repo, "archive", "--format=tar", commit, *paths)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def test_path(name: str) -> str:
    """A --files entry's path: tests/attention/NAME, or tests/NAME for one
    with a folder (utils/test_norm.py)."""
    return f"tests/{name}" if "/" in name else f"tests/attention/{name}"


def prepare(repo: Path, files: list[str], work: Path, legacy: bool) -> list[str]:
    """Copies the tests (device rewritten) and our conftest; returns the test paths."""
    extract(repo, PINNED_COMMIT, ["tests/__init__.py", "tests/test_helpers"], work)
    targets = [test_path(f) for f in files]
    extract(repo, PINNED_COMMIT, targets, work)
    for folder in {Path(t).parent for t in targets}:
        (work / folder / "__init__.py").touch()
    if legacy:
        try:
            extract(repo, LEGACY_COMMIT, [LEGACY_TEST], work / "legacy")
        except subprocess.CalledProcessError:
            print(f"no {LEGACY_COMMIT} in {repo}: its shared-prefix test is left out")
        else:
            src = work / "legacy" / LEGACY_TEST
            shutil.move(src, work / "tests/legacy_v0_1_6_test_shared_prefix_kernels.py")
            targets.append("tests/legacy_v0_1_6_test_shared_prefix_kernels.py")
    for path in work.rglob("*.py"):
        path.write_text(DEVICE_INDEX.sub('.to("cpu")', DEVICE.sub('"cpu"', path.read_text())))
    shutil.copy(Path(__file__).with_name("flashinfer_conftest.py"), work / "tests/conftest.py")
    return targets


def classify(message: str) -> str:
    line = (message.strip().splitlines() or [""])[0]
    return re.sub(r"\d+", "N", line)[:160]


def summarize(results: list[dict]) -> dict:
    per_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    classes: collections.Counter = collections.Counter()
    for r in results:
        path = r["nodeid"].split("::")[0]
        if r["outcome"] == "failed" and NEEDS_CUDA.search(r["message"]):
            outcome = "needs_cuda"
        elif r["outcome"] == "failed" and TOO_LARGE.search(r["message"]):
            outcome = "too_large"
        else:
            outcome = r["outcome"]
        per_file[path][outcome] += 1
        if outcome == "failed":
            classes[classify(r["message"])] += 1
    total = sum(per_file.values(), collections.Counter())
    counted = total["passed"] + total["failed"]
    return {
        "per_file": {k: dict(v) for k, v in sorted(per_file.items())},
        "total": dict(total),
        "pass_rate": total["passed"] / counted if counted else 0.0,
        "failure_classes": classes.most_common(),
    }


def memory_cap(gib: float | None):
    """A preexec_fn capping the pytest process's address space at gib GiB
    (None: no cap). The cap counts mapped, not resident, memory, and MAX maps
    more as a run goes on: for a few files at a time (--per-file), not the
    whole sample in one process."""
    if gib is None:
        return None

    def cap() -> None:
        limit = int(gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return cap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("flashinfer", type=Path, help="FlashInfer checkout or bare clone")
    parser.add_argument(
        "--files",
        nargs="*",
        default=list(FILES),
        help="tests/attention files, or paths under tests/ (utils/test_norm.py)",
    )
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--no-legacy", action="store_true", help=f"skip {LEGACY_COMMIT}'s test")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test")
    parser.add_argument("--seed", type=int, default=0, help="the covering sample's order")
    parser.add_argument("--full-grid", action="store_true", help="every case, not a sample")
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument("--keep", type=Path, default=None, help="work directory to keep")
    parser.add_argument(
        "--memory-cap", type=float, default=None, help="GiB the pytest process may map"
    )
    parser.add_argument(
        "--per-file",
        action="store_true",
        help="one pytest process a file (each under --memory-cap)",
    )
    args = parser.parse_args()

    work = args.keep or Path(tempfile.mkdtemp(prefix="pagedkv-flashinfer-"))
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    targets = prepare(args.flashinfer.resolve(), args.files, work, not args.no_legacy)
    results_path = work / "results.jsonl"
    env = dict(
        os.environ,
        PAGEDKV_FI_RESULTS=str(results_path),
        PAGEDKV_FI_SEED=str(args.seed),
        PAGEDKV_FI_TIMEOUT=str(args.timeout),
        PAGEDKV_FI_FULL_GRID="1" if args.full_grid else "0",
        PAGEDKV_FI_GENERATIONS=json.dumps(GENERATIONS),
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", "."]
    command += ["-o", "addopts=", "--tb=no", "-rN"]
    if args.k:
        command += ["-k", args.k]
    # MAX maps more memory with every op a process compiles: a process a
    # file keeps a large file's references under the cap late in a run.
    for batch in [[t] for t in targets] if args.per_file else [targets]:
        subprocess.run(
            command + batch, cwd=work, env=env, check=False,
            preexec_fn=memory_cap(args.memory_cap),
        )  # fmt: skip
    results_path.touch()
    results = [json.loads(line) for line in results_path.read_text().splitlines()]
    summary = summarize(results)
    print(json.dumps(summary["per_file"], indent=1))
    t = summary["total"]
    print(
        f"passed {t.get('passed', 0)}, failed {t.get('failed', 0)}, "
        f"needs CUDA {t.get('needs_cuda', 0)}, too large for the host "
        f"{t.get('too_large', 0)}, skipped {t.get('skipped', 0)}: "
        f"pass rate {summary['pass_rate']:.1%} of the cases that do not need CUDA"
    )
    for message, count in summary["failure_classes"]:
        print(f"{count:5d}  {message}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
