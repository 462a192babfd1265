"""`pagedkv demo`: the main job, a real model served end to end.

SmolLM2-135M-Instruct (fetched on first use) answers a stream of chat
requests that share a system prompt, with continuous batching over pagedkv's
paged cache, prefix caching and forked samples; every generated token is
then checked against a NumPy implementation of the same model with a dense
KV cache. `--model random` serves a small Llama-style model with random
weights (fixed seed) instead: the same checks in seconds, no download.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pagedkv._ops.kernels import build_kernel_package_in_background

from .model import DecoderConfig, init_weights, quantize_weights
from .scheduler import Request, Scheduler, pages_for

RANDOM = "random"


@dataclass(frozen=True)
class DemoOptions:
    """The demo's flags. layers, qo_heads and kv_heads shape --model random
    only (None: 4, 8 and 2)."""

    device: str = "cpu"
    requests: int = 16
    model: str = "smollm2-135m-instruct"
    layers: int | None = None
    weights: str | None = None
    """gguf, f32 or bf16 (pagedkv.models.forms); None: the device's default."""
    kv_dtype: str | None = None
    """The cache's dtype; None: the weights' default."""
    page_size: int = 16
    max_new_tokens: int = 48
    seed: int = 0
    num_pages: int | None = None
    qo_heads: int | None = None
    kv_heads: int | None = None
    system_prompt: int = 64
    """Tokens of the random model's shared system prompt."""


class DemoError(ValueError):
    """A configuration the demo cannot run; the message says how to fix it."""


SYSTEM_PROMPT = (
    "You are a concise assistant for a travel and science quiz. Answer in one or two "
    "sentences, plainly, without lists. If a question has a single word or number as its "
    "answer, give it first and then one sentence of context."
)
"""The system prompt every real-model request shares (several pages of it
are served from the prefix cache after the first request)."""

QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "What is the largest planet in the solar system?",
    "How many legs does a spider have?",
    "What is the boiling point of water at sea level?",
    "Who wrote Romeo and Juliet?",
    "What is the capital of Japan?",
    "What gas do plants take in from the air?",
    "How many continents are there?",
    "What is the chemical symbol for gold?",
    "Which ocean is the largest?",
    "What is the speed of light?",
    "What is the tallest mountain on Earth?",
    "What is photosynthesis?",
    "What is the capital of Italy?",
    "How many days are in a leap year?",
)


@dataclass
class DemoPlan:
    """What the demo serves: the model, its weights and the requests."""

    title: str
    config: DecoderConfig
    weights: Mapping[str, np.ndarray]
    """float32 weights: what the float graphs and the NumPy reference use
    (with quantized weights, their dequantized blocks)."""
    quantized: dict | None
    """The packed GGUF blocks the quantized graphs multiply, or None."""
    requests: list[Request]
    num_pages: int
    tokenizer: object | None = None
    """The real model's ChatTokenizer (None for the random model)."""
    questions: dict[str, str] | None = None
    """Each real-model request's question, by request id."""
    form: str | None = None
    """The real model's weight form ("gguf", "f32", "bf16"); None: the flags'."""


def demo_requests(config: DecoderConfig, options: DemoOptions) -> list[Request]:
    """Random-model requests sharing a system prompt, with their own suffixes
    and output lengths, arriving four at a time; every fifth asks for two
    samples."""
    rng = np.random.default_rng(options.seed)
    system = rng.integers(0, config.vocab_size, options.system_prompt).tolist()
    requests = []
    for i in range(options.requests):
        suffix = rng.integers(0, config.vocab_size, int(rng.integers(4, 41))).tolist()
        lo = max(1, options.max_new_tokens // 4)
        requests.append(
            Request(
                request_id=f"req{i}",
                prompt=tuple(system + suffix),
                max_tokens=int(rng.integers(lo, options.max_new_tokens + 1)),
                n=2 if i % 5 == 4 else 1,
                arrival_step=(i // 4) * 3,
            )
        )
    return requests


def chat_requests(tokenizer, options: DemoOptions) -> list[Request]:
    """Real-model chat requests: the shared system prompt and one question
    each, arriving four at a time, every fifth with two samples, ending at
    EOS or the token limit."""
    stop = tokenizer.stop_ids
    return [
        Request(
            request_id=f"req{i}",
            prompt=tuple(tokenizer.chat_prompt(QUESTIONS[i % len(QUESTIONS)], SYSTEM_PROMPT)),
            max_tokens=options.max_new_tokens,
            n=2 if i % 5 == 4 else 1,
            arrival_step=(i // 4) * 3,
            stop_token_ids=stop,
        )
        for i in range(options.requests)
    ]


def gpu_visible() -> bool:
    """Whether torch (which holds the GPU pools) and MAX both see a GPU."""
    try:
        import torch
        from max.driver import accelerator_count
    except ImportError:
        return False
    return torch.cuda.is_available() and accelerator_count() > 0


def check_flags(options: DemoOptions) -> None:
    """Raises DemoError for a flag the demo cannot honour (before any load)."""
    if options.device not in ("cpu", "gpu"):
        raise DemoError(f"--device must be cpu or gpu, got {options.device!r}")
    if options.device == "gpu" and not gpu_visible():
        raise DemoError(
            "--device gpu: no CUDA GPU visible to both torch and MAX; use --device cpu "
            "(`pagedkv check-gpu` compiles the GPU kernels without a GPU)"
        )
    from pagedkv.models import ModelError
    from pagedkv.models.forms import check_forms

    try:
        check_forms(weights_of(options), options.kv_dtype, options.device)
    except ModelError as e:
        raise DemoError(str(e)) from None
    for name in ("requests", "layers", "page_size", "max_new_tokens", "qo_heads", "kv_heads"):
        value = getattr(options, name)
        if value is not None and value < 1:
            raise DemoError(f"--{name.replace('_', '-')} must be at least 1")
    if options.model != RANDOM:
        from pagedkv.models import MODELS

        if options.model not in MODELS:
            raise DemoError(
                f"unknown model {options.model!r}: use {', '.join(sorted(MODELS))} or {RANDOM}"
            )
        shaped = [n for n in ("layers", "qo_heads", "kv_heads") if getattr(options, n) is not None]
        if shaped:
            flags = ", ".join("--" + n.replace("_", "-") for n in shaped)
            raise DemoError(f"{flags} shape the random model only: add --model {RANDOM}")


def weights_of(options: DemoOptions) -> str:
    """The demo's weight form: --weights, or the device's default."""
    from pagedkv.models.forms import default_weights

    return options.weights or default_weights(options.device)


RANDOM_MODEL_FORMAT = "Q4_0"
"""The GGUF format of the random model's matrices under --weights gguf."""


def random_config(options: DemoOptions) -> DecoderConfig:
    """The random model's shape from the flags."""
    qo = options.qo_heads or 8
    kv = options.kv_heads or 2
    if qo % kv:
        raise DemoError(
            f"--qo-heads {qo} is not a multiple of --kv-heads {kv}: pick kv heads that divide "
            "the query heads"
        )
    return DecoderConfig(
        num_layers=options.layers or 4, num_qo_heads=qo, num_kv_heads=kv, hidden_size=64 * qo
    )


def size_pool(config: DecoderConfig, requests: list[Request], options: DemoOptions) -> int:
    """Pages per layer: the flag, or 4096 tokens' worth (more if one request
    needs more); a DemoError if a request cannot fit or outgrows the model."""
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    if longest > config.max_positions:
        raise DemoError(
            f"a request would reach {longest} tokens, past the model's maximum of "
            f"{config.max_positions}: lower --max-new-tokens"
        )
    biggest = max(
        r.n * pages_for(len(r.prompt) + r.max_tokens, options.page_size) for r in requests
    )
    num_pages = options.num_pages or max(biggest, 256 * 16 // options.page_size)
    if biggest > num_pages:
        raise DemoError(
            f"a request needs {biggest} pages but the pool holds {num_pages}: raise "
            "--num-pages or lower --max-new-tokens"
        )
    return num_pages


def check_options(options: DemoOptions) -> tuple[DecoderConfig, list[Request], int]:
    """The random model, its requests and the pool size, or a DemoError."""
    check_flags(options)
    config = random_config(options)
    requests = demo_requests(config, options)
    return config, requests, size_pool(config, requests, options)


def plan_demo(options: DemoOptions) -> DemoPlan:
    """Loads what `options` asks to serve (fetching the real model on first
    use), or raises DemoError."""
    check_flags(options)
    if options.model == RANDOM:
        config, requests, num_pages = check_options(options)
        weights, quantized = init_weights(config, options.seed), None
        if weights_of(options) == "gguf":
            weights, quantized = quantize_weights(config, weights, RANDOM_MODEL_FORMAT)
        title = (
            f"{config.num_layers}-layer Llama with random weights (hidden {config.hidden_size}, "
            f"{config.num_qo_heads}/{config.num_kv_heads} heads of {config.head_dim}, vocab "
            f"{config.vocab_size})"
        )
        return DemoPlan(title, config, weights, quantized, requests, num_pages)
    from pagedkv.models import ModelError, fetch_gguf, model_spec
    from pagedkv.models.forms import default_weights
    from pagedkv.models.llm import _read
    from pagedkv.models.tokenizer import ChatTokenizer

    spec = model_spec(options.model)
    try:
        model = _read(fetch_gguf(spec.name).resolve())
    except ModelError as e:
        raise DemoError(str(e)) from None
    tokenizer = ChatTokenizer.from_gguf_metadata(model.metadata)
    requests = chat_requests(tokenizer, options)
    c = model.config
    title = (
        f"{spec.title}, {c.num_layers} layers (hidden {c.hidden_size}, "
        f"{c.num_qo_heads}/{c.num_kv_heads} heads of {c.head_dim}, vocab {c.vocab_size})"
    )
    num_pages = size_pool(c, requests, options)
    questions = {r.request_id: QUESTIONS[i % len(QUESTIONS)] for i, r in enumerate(requests)}
    # A model the quantized product does not serve runs its float32 weights
    # unless told otherwise (as `load` does).
    form = options.weights or (default_weights(options.device) if model.quantized else "f32")
    quantized = model.quantized if form == "gguf" else None
    if form == "gguf" and not quantized:
        raise DemoError(
            f"{spec.title}: the quantized product does not serve its formats; use --weights f32"
        )
    return DemoPlan(
        title, c, model.weights, quantized, requests, num_pages, tokenizer, questions, form
    )


LOGIT_TOLERANCE = {
    ("f32", "cpu"): 1e-3,
    ("f32", "gpu"): 0.25,
    ("gguf", "cpu"): 0.05,
    ("bf16", "cpu"): 2.5,
    ("bf16", "gpu"): 2.5,
}
"""The largest engine-vs-reference logit difference a run may show, by
weights and device, with the weights' own cache dtype (float32 beside GGUF
weights; other caches are reported, not checked). A wrong kernel is off by
O(1) in float32 and by tens in bfloat16. A GPU's float32 step graphs (MAX's
own matmuls) compute at a lower precision than the CPU's; bfloat16 rounds
weights and activations to 8 significant bits, which drifts by about a
logit over a 30-layer model; the quantized graphs keep float32
intermediates that the reference keeps in float64, and each product
quantizes its activations again, where a value a rounding away from a code
boundary can land one code apart (observed differences: docs/gpu.md,
"The demo's self-check")."""
CHECKED_CACHE = {"f32": "float32", "gguf": "float32", "bf16": "bfloat16"}
"""The cache dtype beside each weight form whose runs LOGIT_TOLERANCE holds."""


def run_demo(options: DemoOptions) -> int:
    """Runs the demo and prints its summary; returns the exit status."""
    from .decoder import quantized_formats
    from .engine import DecoderEngine, page_manager_for
    from .self_check import check_sequences

    build_kernel_package_in_background()  # overlaps reading the model
    plan = plan_demo(options)
    config, requests = plan.config, plan.requests
    samples = sum(r.n for r in requests)
    from pagedkv.models.forms import check_forms

    weights = plan.form or weights_of(options)
    kv_dtype = check_forms(weights, options.kv_dtype, options.device)
    print(
        f"pagedkv demo: {len(requests)} requests ({samples} sequences), {plan.title}, "
        f"{weights} weights, {kv_dtype} cache, {options.device}, {plan.num_pages} pages of "
        f"{options.page_size} tokens",
        flush=True,
    )
    manager = page_manager_for(config, plan.num_pages, options.page_size, kv_dtype, options.device)
    print("compiling the prefill and decode graphs ...", flush=True)
    engine = DecoderEngine(config, plan.weights, manager, plan.quantized)
    print(
        f"compile: {engine.compile_seconds:.1f} s (cached on disk: later runs load it)", flush=True
    )
    total = sum(r.n * r.max_tokens for r in requests)
    scheduler = Scheduler(engine, keep_logits=True, max_num_seqs=samples)
    sequences, stats = scheduler.run(requests, on_step=Progress(total).update)
    print(file=sys.stderr)
    if plan.tokenizer is not None:
        print_answers(plan.tokenizer, plan.questions, sequences)

    generated = sum(len(s.tokens) for s in sequences)
    decode_ms = np.array(stats.decode_step_seconds) * 1e3
    print(
        f"run: {stats.steps} steps, {generated} tokens generated ({stats.prefill_tokens} "
        f"prompt tokens prefilled) in {stats.seconds:.1f} s: "
        f"{generated / stats.seconds:.1f} tokens/s"
    )
    if len(decode_ms):
        print(
            f"decode step latency: median {np.median(decode_ms):.1f} ms, "
            f"p99 {np.percentile(decode_ms, 99):.1f} ms over {len(decode_ms)} steps"
        )
    else:  # every sequence ended with the token its prefill sampled
        print("decode step latency: no decode steps")
    leaked = manager.num_used_pages
    print(
        f"pages: peak {stats.peak_used_pages} of {plan.num_pages} in use, {leaked} at the end "
        f"({'none' if leaked == 0 else leaked} leaked), {manager.num_cached_pages} kept "
        "cached for prefix reuse"
    )
    print(
        f"prefix cache: {manager.stats.prefix_hits} page hits, {manager.stats.prefix_misses} misses"
    )
    t0 = time.perf_counter()
    products = (
        quantized_formats(plan.quantized, config.num_layers).products if plan.quantized else ()
    )
    check = check_sequences(config, plan.weights, sequences, quantized=products)
    tolerance = LOGIT_TOLERANCE.get((weights, options.device))
    checked = tolerance is not None and kv_dtype == CHECKED_CACHE[weights]
    close = tolerance is None or check.max_logit_diff <= tolerance
    verdict = "PASS" if (check.passed and close) or not checked else "FAIL"
    form = "quantized activations, " if plan.quantized is not None else ""
    print(
        f"self-check against the NumPy dense-cache model ({form}float64): {check.tokens} "
        f"tokens, {check.tokens - len(check.mismatches)} equal, {check.near_ties} near-ties, "
        f"max |logit diff| {check.max_logit_diff:.2e} ({time.perf_counter() - t0:.1f} s): "
        f"{verdict}"
        + ("" if checked else f" ({weights}, {kv_dtype} cache: agreement reported, not required)")
    )
    if checked and not close:
        print(f"  max |logit diff| is over {tolerance} on the {options.device}")
    for line in check.mismatches[:5]:
        print(f"  mismatch: {line}")
    if leaked:
        print("FAIL: pages leaked")
        return 1
    return 0 if verdict == "PASS" else 1


def print_answers(tokenizer, questions: dict[str, str], sequences) -> None:
    """Each sequence's question and answer (answers on one line, cut at 100
    characters)."""
    for s in sequences:
        question = questions[s.request.request_id]
        answer = " ".join(tokenizer.decode(s.tokens).split())
        cut = answer if len(answer) <= 100 else answer[:99] + "\u2026"
        print(f"  {s.seq_id:8s} {question}\n           -> {cut}")


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total_tokens: int) -> None:
        self.total = max(total_tokens, 1)
        self.t0 = time.perf_counter()

    def update(self, step: int, tokens: int, running: int) -> None:
        done = min(tokens / self.total, 1.0)
        bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
        rate = tokens / max(time.perf_counter() - self.t0, 1e-9)
        print(
            f"\r[{bar}] step {step:4d}  tokens {tokens:5d}  running {running:3d}  "
            f"{rate:6.1f} tok/s",
            end="",
            file=sys.stderr,
            flush=True,
        )
