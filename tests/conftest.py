"""Shared test helpers: arrays of each dtype and kind, and their raw bits."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

# No deadline for any property test: an example slowed by a busy machine is
# not a failure (a test may still set its own bounds on counts).
settings.register_profile("pagedkv", deadline=None)
settings.load_profile("pagedkv")

import background  # noqa: E402  (from this folder, put on the path above)
import suite_graphs  # noqa: E402
import warm_graphs  # noqa: E402

TORCH_ONLY = {"bfloat16", "float8_e4m3fn", "float8_e5m2"}

MODEL_DEVICE = os.environ.get("PAGEDKV_TEST_DEVICE", "cpu")
"""Where the real model's tests (test_smollm2, test_serve) load it: "cpu", or
"gpu" to hold the GPU path to the same references (needs a CUDA GPU)."""


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU and MAX an accelerator."""
    try:
        import torch
        from max.driver import accelerator_count
    except ImportError:
        return False
    return torch.cuda.is_available() and accelerator_count() > 0


@pytest.fixture(autouse=True)
def gpu_test(request):
    """A test marked `gpu` (a GPU path against the CPU suite's references,
    beside the CPU test it mirrors) skips without a CUDA GPU and finds the
    GPU ops compiled in one module.
    `python -m pytest -m gpu` runs them all, as a lent GPU machine does."""
    if request.node.get_closest_marker("gpu") is None:
        return
    if not cuda_available():
        pytest.skip("needs a CUDA GPU")
    request.getfixturevalue("compiled_gpu_ops")


@pytest.fixture(scope="session")
def compiled_gpu_ops():
    """Compiles the GPU ops the `gpu` tests run in one MAX module."""
    from max.dtype import DType

    from pagedkv._ops.kernels import prepare
    from pagedkv._ops.tensors import Device
    from pagedkv.decode import decode_spec
    from pagedkv.precompile import op_specs
    from pagedkv.prefill import prefill_spec

    layouts = {"NHD": 0, "HND": 1}
    pairs = sorted({(q, kv) for q, kv, _, _ in DECODE_CONFIGS} | {("bfloat16", "bfloat16")})
    specs = op_specs(("float32", "float16", "bfloat16"), pairs) + [
        prefill_spec(DType[q], DType[kv], layouts[layout]) for q, kv, layout in PREFILL_CONFIGS
    ]
    specs += [
        decode_spec(DType.bfloat16, DType.bfloat16, 0),
        prefill_spec(DType.bfloat16, DType.bfloat16, 0),
    ]
    prepare(list(dict.fromkeys(specs)), Device("gpu"))


def random_array(rng: np.random.Generator, shape, dtype: str, kind: str = "numpy"):
    """Normal values rounded to dtype, as a NumPy array or a torch tensor."""
    values = rng.standard_normal(shape, dtype=np.float32)
    if kind == "numpy" and dtype not in TORCH_ONLY:
        return values.astype(dtype)
    import torch

    return torch.from_numpy(values).to(getattr(torch, dtype))


def bits(x) -> np.ndarray:
    """The raw bit patterns of x (for exact, NaN-safe comparisons)."""
    if isinstance(x, np.ndarray):
        return x.view(f"u{x.dtype.itemsize}").copy()
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
    return x.view(width).cpu().numpy().copy()


def to_numpy(x) -> np.ndarray:
    """An array or a tensor (any device) as NumPy; floats as float32."""
    if isinstance(x, np.ndarray):
        return x
    x = x.cpu()
    return x.float().numpy() if x.dtype.is_floating_point else x.numpy()


def like(x, values: np.ndarray):
    """values as the kind of x (torch tensors stay torch)."""
    if isinstance(x, np.ndarray):
        return values
    import torch

    return torch.from_numpy(values).to(x.device)


def cast(values: np.ndarray, dtype: str):
    """float32 values as a torch tensor of dtype (NumPy for float32)."""
    if dtype == "float32":
        return values
    import torch

    return torch.from_numpy(values).to(getattr(torch, dtype))


def as_f64(x) -> np.ndarray:
    """An array or a tensor (any device) as float64 NumPy."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    return x.float().cpu().numpy().astype(np.float64)


def to_device(x, device: str):
    """x (an array, a tensor, or a tuple of them) on device: "cpu" leaves it
    as it is; "cuda" makes torch CUDA tensors of it."""
    if device == "cpu":
        return x
    if isinstance(x, tuple):
        return tuple(to_device(y, device) for y in x)
    import torch

    return (torch.from_numpy(x) if isinstance(x, np.ndarray) else x).to(device)


def parameter_names(function) -> list[str]:
    """function's parameter names in order: what its positional calls bind to."""
    import inspect

    return list(inspect.signature(function).parameters)


def wait_until_serving(process, url: str, seconds: float) -> None:
    """Returns once `url`/health answers 200; fails the test if `process`
    (a subprocess.Popen of the server) ends first or `seconds` pass."""
    import time

    import httpx

    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, f"the server ended with status {process.returncode}"
        assert time.monotonic() < deadline, f"{url} did not answer in {seconds} s"
        try:
            httpx.get(f"{url}/health", timeout=1.0).raise_for_status()
            return
        except httpx.HTTPError:
            time.sleep(0.2)


def flashinfer_serves(module: str, name: str) -> bool:
    """Whether `import flashinfer...` with pagedkv's stand-in installed finds
    pagedkv's own `name` in `module` (a dotted name under flashinfer)."""
    import importlib

    import pagedkv
    import pagedkv.flashinfer_compat as compat

    compat.install()
    return getattr(importlib.import_module(module), name) is getattr(pagedkv, name)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# (q dtype, kv dtype, layout, pool form) the decode tests cover. One graph
# serves both pool forms, so these compile 2 + 4 decode graphs: both layouts
# in float32, one layout for each other dtype pair.
DECODE_CONFIGS = [
    ("float32", "float32", "NHD", "pool"),
    ("float32", "float32", "HND", "pool"),
    ("float32", "float32", "NHD", "pair"),
    ("float32", "float32", "HND", "pair"),
    ("float16", "float16", "NHD", "pool"),
    ("bfloat16", "bfloat16", "HND", "pair"),
    ("float16", "float8_e4m3fn", "NHD", "pool"),
    ("bfloat16", "float8_e5m2", "HND", "pair"),
]

# (q dtype, kv dtype, layout) that only test_decode's TASK_SHAPES use: the
# bfloat16 NHD rows the CPU kernel takes in sub-blocks. Compiled in the same
# module as the rest (a graph of its own costs a fixed ~30 s).
TASK_ONLY_DECODE_CONFIGS = [("bfloat16", "bfloat16", "NHD")]

# (q dtype, kv dtype, layout) that only the block-table APIs' tests run:
# TRT-LLM's fp8 query (widened to bfloat16) over an e4m3 cache.
API_ONLY_DECODE_CONFIGS = [("bfloat16", "float8_e4m3fn", "HND")]

# (q dtype, kv dtype, layout) of every decode graph the suite compiles.
COMPILED_DECODE_CONFIGS = list(
    dict.fromkeys(
        [c[:3] for c in DECODE_CONFIGS] + TASK_ONLY_DECODE_CONFIGS + API_ONLY_DECODE_CONFIGS
    )
)


# (q dtype, kv dtype) of the MLA tests in the main suite; the other pairs
# are in the slow set (each pair is a compile of its own).
MLA_CONFIGS = [("float32", "float32"), ("bfloat16", "bfloat16")]

# (q dtype, kv dtype) of MLA that only the block-table API's tests run:
# FlashInfer's fp8 MLA, its query widened to bfloat16.
API_ONLY_MLA_CONFIGS = [("bfloat16", "float8_e4m3fn")]


# (q dtype, kv dtype, layout) the prefill tests cover.
PREFILL_CONFIGS = [
    ("float32", "float32", "NHD"),
    ("bfloat16", "bfloat16", "HND"),
    ("float16", "float8_e4m3fn", "NHD"),
]


@pytest.fixture(scope="session", autouse=True)
def compiled_ops(request):
    """Compiles every op the suite runs, and the graphs its tests build
    (suite_graphs.py), in one MAX module (one fixed cost).

    Skipped when only GPU tests run (those marked `gpu`, and the real
    model's tests with PAGEDKV_TEST_DEVICE=gpu): they compile GPU modules of
    their own, and minutes of CPU compiles would be wasted on a lent GPU
    machine.
    """
    model_files = (
        {"test_smollm2.py", "test_serve.py", "test_gemma3.py"} if MODEL_DEVICE == "gpu" else set()
    )
    if all(
        item.get_closest_marker("gpu") is not None or item.path.name in model_files
        for item in request.session.items
    ):
        return
    from max.dtype import DType

    from pagedkv._ops.cpu_target import isa_probe_spec
    from pagedkv._ops.kernels import prepare
    from pagedkv._ops.tensors import CPU
    from pagedkv.decode import decode_spec
    from pagedkv.mla import mla_spec
    from pagedkv.page import append_spec, gather_spec
    from pagedkv.precompile import op_specs
    from pagedkv.prefill import prefill_spec

    layouts = {"NHD": 0, "HND": 1}
    attention = list(
        dict.fromkeys(
            [
                decode_spec(DType[q], DType[kv], layouts[layout])
                for q, kv, layout in COMPILED_DECODE_CONFIGS
            ]
            + [
                prefill_spec(DType[q], DType[kv], layouts[layout])
                for q, kv, layout in PREFILL_CONFIGS
            ]
            + [mla_spec(DType[q], DType[kv]) for q, kv in MLA_CONFIGS + API_ONLY_MLA_CONFIGS]
            # tests/api/test_int8_cache.py's reads of int8 pools (decode's
            # and prefill's specs are one op).
            + [prefill_spec(DType.float32, DType.int8, layout) for layout in (0, 1)]
        )
    )
    pairs = sorted({(q, kv) for q, kv, _, _ in DECODE_CONFIGS})
    # op_specs' own decode and prefill variants give way to those above.
    attention_ops = {s.name for s in attention}
    page_and_merge = [
        s
        for s in op_specs(("float32", "float16", "bfloat16"), pairs)
        if s.name not in attention_ops
    ]
    # The int8 appends and gathers tests/api/test_int8_cache.py runs.
    page_and_merge += [
        append_spec(DType.int8, layout, DType[rows])
        for layout, rows in ((0, "float32"), (1, "bfloat16"), (0, "float16"))
    ] + [gather_spec(DType.int8, layout) for layout in (0, 1)]
    # tests/ops/test_cpu_target.py's probe of the host's branches.
    page_and_merge.append(isa_probe_spec())
    if suite_graphs.registered():
        suite_graphs.keep(
            prepare(
                page_and_merge + attention,
                CPU,
                graphs=suite_graphs.build_all,
                key=("tests.suite_graphs", suite_graphs.compile_key()),
            )
        )
    else:
        prepare(page_and_merge + attention, CPU)


def pytest_configure(config):
    """Starts building the Mojo kernel package (seconds, once per source
    version) while pytest collects: every compile of the run waits for it."""
    from pagedkv._ops.kernels import build_kernel_package_in_background

    build_kernel_package_in_background()


def pytest_collection_finish(session):
    """Starts the selected GPU compile checks (minutes each) and the model
    graphs the selected CPU tests name (warm_graphs.py) compiling in the
    background, beside the CPU tests (see background.py)."""
    checks = [
        item
        for item in session.items
        if getattr(item, "originalname", "") == "test_gpu_paths_compile"
    ]
    warm = (
        []
        if MODEL_DEVICE == "gpu"
        else [
            name
            for item in session.items
            if item.get_closest_marker("gpu") is None
            for name in getattr(item.module, "WARM_GRAPHS", ())
        ]
    )
    if (not checks and not warm) or session.config.option.collectonly:
        return
    from pagedkv._ops.kernels import kernel_package

    try:
        kernel_package()  # built once here, not by each process at once
    except RuntimeError:
        pass  # a kernel that does not compile fails in the tests themselves
    warm_graphs.start(list(dict.fromkeys(warm)))
    for item in checks:
        arch, flags = item.callspec.params["arch"], item.callspec.params["flags"]
        argv = item.module.gpu_check_argv(arch, flags)
        background.start(" ".join(argv), argv)


def pytest_sessionfinish(session, exitstatus):
    background.stop_all()
    warm_graphs.forget()


@pytest.fixture(scope="session", autouse=True)
def forget_unpacked_copies_of_temporary_ggufs(tmp_path_factory):
    """Tests read tiny GGUFs written into pytest's temporary folders; their
    unpacked copies land in the cache directory (the one whose compiled
    graphs the suite reuses run after run) and are removed when the session
    ends, so that runs do not pile them up."""
    yield
    import shutil

    from pagedkv.models.unpacked import copies

    temporary = tmp_path_factory.getbasetemp().resolve()
    for folder, gguf in copies():
        if gguf is not None and gguf.is_relative_to(temporary):
            shutil.rmtree(folder.parent, ignore_errors=True)


# The demo's random Llama (pagedkv.graphs.model.DecoderConfig()), shared by the
# step-graph and scheduler tests: one compile of its step graphs per process.
DEMO_PAGE = 16


def _demo_config():
    from pagedkv.graphs.model import DecoderConfig

    return DecoderConfig()


DEMO_CONFIG = _demo_config()


@pytest.fixture(scope="session")
def weights(tmp_path_factory):
    """The demo's random weights, memory-mapped from .npy files as a real
    model's unpacked copy is: the step graphs then run on panels packed into
    files beside them, which only the compiled models keep alive."""
    from pagedkv.graphs.model import init_weights

    folder = tmp_path_factory.mktemp("weights")
    mapped = {}
    for i, (name, array) in enumerate(init_weights(DEMO_CONFIG, 0).items()):
        np.save(folder / f"{i}.npy", array)
        mapped[name] = np.load(folder / f"{i}.npy", mmap_mode="r")
    return mapped


def engine_with_pool(weights, num_pages: int, batch_invariant: bool = False):
    """A `DecoderEngine` of the demo's model over a fresh pool of num_pages pages."""
    from pagedkv.cache.manager import PagedKVCacheManager
    from pagedkv.graphs.engine import DecoderEngine

    c = DEMO_CONFIG
    manager = PagedKVCacheManager(
        num_pages, DEMO_PAGE, c.num_kv_heads, c.head_dim, num_layers=c.num_layers
    )
    return DecoderEngine(c, weights, manager, batch_invariant=batch_invariant)


def assert_greedy_steps_match(engine, config, weights, ids, prompts, decode_steps: int):
    """Adds requests `ids` to the engine's manager, prefills their prompts in
    one step, then runs decode_steps greedy decode steps: every step's
    logits [len(ids), vocab] equal the dense NumPy model's within 1e-4.
    Returns the last step's (logits, the reference's logits)."""
    from pagedkv.graphs.numpy_reference import DenseDecoder

    for i in ids:
        engine.manager.add(i)
    refs = [DenseDecoder(config, weights) for _ in prompts]
    logits = engine.prefill(ids, prompts)
    want = np.stack([r.feed(p) for r, p in zip(refs, prompts, strict=True)])
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
    for _ in range(decode_steps):
        nxt = want.argmax(-1)
        logits = engine.decode(ids, nxt)
        want = np.stack([r.feed([int(t)]) for r, t in zip(refs, nxt, strict=True)])
        np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
    return logits, want


def shared_prompt_requests(rng, vocab_size, system_tokens, own_tokens, max_tokens, forked):
    """Requests r0, r1, ... on one random system prompt of system_tokens
    tokens: request i with own_tokens[i] random tokens of its own after it,
    generating max_tokens[i] tokens; request `forked` sampled twice."""
    from pagedkv.graphs.scheduler import Request

    system = rng.integers(0, vocab_size, system_tokens).tolist()
    return [
        Request(
            f"r{i}",
            tuple(system + rng.integers(0, vocab_size, own).tolist()),
            max_tokens=count,
            n=2 if i == forked else 1,
        )
        for i, (own, count) in enumerate(zip(own_tokens, max_tokens, strict=True))
    ]


def assert_exact_and_released(engine, config, weights, sequences):
    """`assert_released`, and every generated token is the NumPy
    reference's (`assert_reference_tokens`); returns the reference's check."""
    assert_released(engine)
    return assert_reference_tokens(config, weights, sequences)


def assert_released(engine):
    """Every page the engine's manager lent came back, and its books
    validate."""
    assert engine.manager.num_used_pages == 0
    engine.manager.validate()


def assert_reference_tokens(config, weights, sequences):
    """Every token of the float32 engine's sequences (kept logits) is the
    NumPy model's choice, near-ties aside, from logits within 1e-4 of the
    logits' largest magnitude (float32 rounding is about 2e-6 of it). The
    bound matters: `check_sequences` forgives a wrong token as a near-tie
    when the logits are far off, as a wrong key or value in a recomputed or
    shared page makes them. Returns the check."""
    from pagedkv.graphs.self_check import check_sequences

    check = check_sequences(config, weights, sequences)
    assert check.passed, check.mismatches
    scale = max((float(np.abs(row).max()) for s in sequences for row in s.logits), default=0.0)
    assert check.max_logit_diff <= 1e-4 * scale, (check.max_logit_diff, scale)
    return check


class Gate:
    """A step engine whose decode steps wait until the gate opens (the
    server tests hold requests in flight with it; waits are hang guards)."""

    def __init__(self, inner, timeout: float = 600.0) -> None:
        import threading

        self.inner = inner
        self.timeout = timeout
        self.opened = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, *args):
        assert self.opened.wait(self.timeout)
        return self.inner.decode(*args)


@pytest.fixture(scope="session")
def redis_url():
    """A Redis server of its own on a loopback port (the system's
    `redis-server`), with nothing persisted; yields its URL."""
    import shutil
    import subprocess
    import time

    redis = pytest.importorskip("redis", reason="the distributed extra (redis) is not installed")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    from pagedkv.serve.server import free_port

    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=2)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def grammars() -> tuple:
    """(SmolLM2's tokenizer, a grammar engine over its vocabulary), built
    once per session for the tool and format tests: its tables take
    seconds; matchers keep their own state."""
    from pagedkv.graphs.structured import Grammars
    from pagedkv.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    return tokenizer, Grammars(tokenizer.tokenizer, 49152, tokenizer.stop_ids)
