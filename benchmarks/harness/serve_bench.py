"""Serving a catalogue model (SmolLM2-135M-Instruct by default, or Gemma 3
270M): pagedkv beside HF transformers, one run.

32 chat requests (all arriving at once), 64 new tokens each, greedy, EOS
ignored on both sides so every request generates exactly 64 tokens:

- pagedkv: continuous batching over the paged cache (prefix cache on: the
  requests share the chat template's system prompt), one compiled graph per
  step, float32 and bfloat16;
- transformers `generate`, batched with left padding, with its default
  (dynamic) cache and with its static cache, float32 and bfloat16;
- transformers one request at a time (float32).

Reported per row: generated tokens/s, time to first token p50/p99 (from the
moment all requests arrive) and KV-cache bytes per generated-or-prompt token
(what the cache held at its peak over the tokens it served). The ratios
compare each row's tokens/s with pagedkv float32's.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass

import numpy as np

from pagedkv.graphs.demo import QUESTIONS
from pagedkv.models.catalog import DEFAULT_MODEL as MODEL

PROMPTS = QUESTIONS + (
    "Write a haiku about the sea.",
    "Explain in two sentences what a KV cache is.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to play the guitar.",
    "Name a famous painting by Leonardo da Vinci.",
    "What should I cook for dinner tonight?",
    "How do bees make honey?",
    "What is the difference between weather and climate?",
    "Suggest a name for a pet turtle.",
    "Why do we have seasons?",
    "What is a prime number?",
    "Describe a rainbow to someone who has never seen one.",
    "What are the benefits of drinking water?",
    "How does a bicycle stay upright?",
)
NEW_TOKENS = 64
WEIGHTS = {"float32": "f32", "bfloat16": "bf16", "gguf": "gguf"}
"""pagedkv's weight form of each dtype row ("gguf": the GGUF's own blocks,
a float16 cache; pagedkv only)."""


@dataclass
class ServeRow:
    name: str
    dtype: str
    tokens: int
    seconds: float
    ttft: list[float]
    kv_bytes_per_token: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def cpu_model() -> str:
    """The CPU's model name and its vector extensions that matter here."""
    name, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name in ("", "unknown CPU", "x86_64"):
                    name = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} ({', '.join(isa) or 'no AVX'})"


def run_pagedkv(
    dtype: str, prompts: tuple[str, ...], device: str = "cpu", llm=None, model: str = MODEL
) -> ServeRow:
    """pagedkv's continuous batching over the paged cache (`llm`: a loaded
    model to reuse, else `model` loaded on `device`)."""
    from pagedkv.graphs.scheduler import Request, Scheduler
    from pagedkv.models import load

    llm = llm or load(model, weights=WEIGHTS[dtype], device=device)
    ids = [tuple(llm.prompt_ids(p)) for p in prompts]
    # First executes (allocations, caches) on another prompt: only the chat
    # template's system prompt is left in the prefix cache, as on a server.
    warm = [Request(f"warm{i}", tuple(llm.prompt_ids("Hello.")), 2) for i in range(4)]
    Scheduler(llm.engine).run(warm)
    requests = [Request(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(ids)]
    first: dict[str, float] = {}
    t0 = time.perf_counter()

    def on_token(seq, token: int) -> None:
        first.setdefault(seq.seq_id, time.perf_counter() - t0)

    sequences, stats = Scheduler(llm.engine).run(requests, on_token=on_token)
    seconds = time.perf_counter() - t0
    tokens = sum(len(s.tokens) for s in sequences)
    c = llm.config
    itemsize = 4 if dtype == "float32" else 2
    page_bytes = 2 * llm.manager.page_size * c.num_kv_heads * c.head_dim * itemsize * c.num_layers
    served = sum(len(p) for p in ids) + tokens
    return ServeRow(
        f"pagedkv, continuous batching, {len(prompts)} requests",
        dtype,
        tokens,
        seconds,
        [first[s.seq_id] for s in sequences],
        stats.peak_used_pages * page_bytes / served,
    )


def _hf_model(dtype: str, device: str = "cpu", model: str = MODEL):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedkv.models import fetch_gguf

    gguf = fetch_gguf(model)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.padding_side = "left"
    # Some transformers versions read no pad token from the GGUF; padded
    # positions are masked, so any token does.
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    hf = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)
    )
    hf.eval()
    if device == "gpu":
        hf.to("cuda")
    return tokenizer, hf, _chat_tokenizer(model)


def _hf_kv_bytes(model, dtype: str) -> int:
    c = model.config
    itemsize = 4 if dtype == "float32" else 2
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * itemsize


def _chat_tokenizer(model: str):
    """pagedkv's tokenizer of `model` (its chat template, or the family's
    turn format where the GGUF carries none, as pagedkv serves it)."""
    from pagedkv.models import fetch_gguf
    from pagedkv.models.tokenizer import ChatTokenizer
    from pagedkv.models.unpacked import read_unpacked

    return ChatTokenizer.from_gguf_metadata(read_unpacked(fetch_gguf(model)).metadata)


def _chat(chat_tokenizer, prompt: str) -> str:
    """The chat prompt's text; its BOS, if the model has one, comes from the
    transformers tokenizer (add_special_tokens)."""
    return chat_tokenizer.render_chat([{"role": "user", "content": prompt}])


def run_hf_batched(dtype: str, cache: str, prompts: tuple[str, ...], model=None) -> ServeRow:
    """transformers generate() over all prompts at once, left-padded; every
    request's first token arrives with the batch's prefill."""
    import torch

    tokenizer, model, chat = model or _hf_model(dtype)
    texts = [_chat(chat, p) for p in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=chat.add_bos)
    batch = batch.to(model.device)
    kwargs = dict(
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        model.generate(**batch, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
        t0 = time.perf_counter()
        n = NEW_TOKENS
        out = model.generate(**batch, max_new_tokens=n, min_new_tokens=n, **kwargs)
        seconds = time.perf_counter() - t0
    tokens = (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)
    held = out.shape[0] * out.shape[1]  # padded rows: every position is cached
    served = int(batch["attention_mask"].sum()) + tokens
    ttft = _hf_prefill_seconds(model, batch)
    return ServeRow(
        f"transformers, batched ({cache} cache), {len(prompts)} requests",
        dtype,
        tokens,
        seconds,
        [ttft] * len(prompts),
        held * _hf_kv_bytes(model, dtype) / served,
    )


def _hf_prefill_seconds(model, batch) -> float:
    """The batched prefill's time: when every request's first token exists."""
    import torch

    with torch.inference_mode():
        _synchronize(model)
        t0 = time.perf_counter()
        model(**batch)
        _synchronize(model)
        return time.perf_counter() - t0


def _synchronize(model) -> None:
    """Waits for the model's GPU work (a no-op on the CPU)."""
    import torch

    if model.device.type == "cuda":
        torch.cuda.synchronize()


def run_hf_one_at_a_time(dtype: str, prompts: tuple[str, ...], model=None) -> ServeRow:
    """transformers generate() on each prompt alone, in turn (all arrived at
    the start, so a request's first token waits for those before it)."""
    import torch

    tokenizer, model, chat = model or _hf_model(dtype)
    tokens, ttft = 0, []
    kwargs = dict(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )
    with torch.inference_mode():
        t0 = time.perf_counter()
        for p in prompts:
            ids = tokenizer(_chat(chat, p), return_tensors="pt", add_special_tokens=chat.add_bos)
            start = time.perf_counter()
            model(**ids)  # the prefill alone: its end is this request's first token
            ttft.append(time.perf_counter() - t0)
            t_gen = time.perf_counter()
            out = model.generate(**ids, **kwargs)
            # The separate prefill above is not part of serving: take it back out.
            t0 += t_gen - start
            tokens += out.shape[1] - ids["input_ids"].shape[1]
        seconds = time.perf_counter() - t0
    return ServeRow("transformers, one at a time", dtype, tokens, seconds, ttft, 0.0)


def format_serve_table(machine: str, rows: list[ServeRow], model: str = MODEL) -> str:
    base = next((r for r in rows if r.name.startswith("pagedkv") and r.dtype == "float32"), None)
    lines = [
        f"{model}, chat requests x {NEW_TOKENS} new tokens, greedy; {machine}",
        "| server | dtype | tokens/s | pagedkv f32 / this | TTFT p50 s | TTFT p99 s "
        "| KV bytes/token |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{base.tokens_per_s / r.tokens_per_s:.2f}" if base else "-"
        kv = f"{r.kv_bytes_per_token:,.0f}" if r.kv_bytes_per_token else "-"
        lines.append(
            f"| {r.name} | {r.dtype} | {r.tokens_per_s:.1f} | {ratio} | "
            f"{np.percentile(r.ttft, 50):.2f} | {np.percentile(r.ttft, 99):.2f} | {kv} |"
        )
    return "\n".join(lines)


def prompts_for(count: int) -> tuple[str, ...]:
    """`count` chat prompts: PROMPTS, cycled."""
    return tuple(PROMPTS[i % len(PROMPTS)] for i in range(count))


def main(
    dtypes: list[str],
    one_at_a_time: int,
    device: str = "cpu",
    counts: tuple[int, ...] = (len(PROMPTS),),
    model: str = MODEL,
) -> None:
    """Runs every row and prints the table (markdown): pagedkv and
    transformers batched at each request count in `counts`, on `device`."""
    import torch

    from .threads import pin_max_workers

    pin_max_workers()
    if device == "gpu":
        machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    else:
        machine = f"{cpu_model()}, torch {torch.__version__} on {torch.get_num_threads()} threads"
    rows = []
    for dtype in dtypes:
        from pagedkv.models import load

        llm = load(model, weights=WEIGHTS[dtype], device=device)
        for count in counts:
            rows.append(run_pagedkv(dtype, prompts_for(count), device, llm))
            print(f"{rows[-1].name} {dtype}: {rows[-1].tokens_per_s:.1f} tokens/s", flush=True)
        del llm
    for dtype in (d for d in dtypes if d != "gguf"):
        hf = _hf_model(dtype, device, model)
        for count in counts:
            for cache in ("dynamic", "static"):
                rows.append(run_hf_batched(dtype, cache, prompts_for(count), hf))
                print(f"{rows[-1].name} {dtype}: {rows[-1].tokens_per_s:.1f} tokens/s", flush=True)
        if dtype == "float32" and one_at_a_time and device == "cpu":
            rows.append(run_hf_one_at_a_time(dtype, PROMPTS[:one_at_a_time], hf))
            print(f"{rows[-1].name}: {rows[-1].tokens_per_s:.1f} tokens/s", flush=True)
    print()
    print(format_serve_table(machine, rows, model))
