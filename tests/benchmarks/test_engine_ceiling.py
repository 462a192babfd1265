"""benchmarks/engine_ceiling.py drives the scheduler as `pagedkv serve`
builds it: a small shared-prefix workload runs to every request's full
answer, its prompt in chunks of the server's prefill budget."""

from __future__ import annotations

from engine_ceiling import run_workload
from serve_vs_llamacpp import Workload

from pagedkv.models import load


def test_a_small_shared_prefix_workload_runs_to_full_answers():
    llm = load("smollm2-135m-instruct", weights="gguf", kv_memory=16 << 20)
    w = Workload("shared-prefix", clients=2, requests=3, max_tokens=4, shared_prefix=True)
    figures = run_workload(llm, w, "t")
    # The 930-token system prompt takes two prefill calls of at most 512
    # tokens before any question's; three answers of 4 tokens take at
    # least two rounds of 3 decode steps (2 clients).
    assert figures["prefills"] >= 3
    assert figures["decodes"] >= 6
    assert figures["seconds"] >= figures["prefill_s"] + figures["decode_s"]
    assert figures["tokens_per_s"] == 12 / figures["seconds"]
