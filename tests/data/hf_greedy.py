"""transformers' greedy float32 continuation of one prompt, as the record
the exactness tests compare, and the JSON file of such records: shared by
the reference scripts beside it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path


def load_float32(gguf):
    """transformers' tokenizer and float32 model from a GGUF path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.eval()
    return tokenizer, model


def greedy_record(
    model, tokenizer, prompt: str, ids: list[int], max_new_tokens: int, stop, pad: int
) -> dict:
    """The prompt, its token ids, the generated ids (ending after a `stop`
    id or at the limit), the gap between the top two logits of each
    generated token (where a near-tie lets float rounding pick either) and
    the generated text."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=stop,
            pad_token_id=pad,
        )
    generated = out.sequences[0, len(ids) :].tolist()
    gaps = []
    for step_logits in out.logits[: len(generated)]:
        top2 = torch.topk(step_logits[0].double(), 2).values
        gaps.append(float(top2[0] - top2[1]))
    return {
        "prompt": prompt,
        "prompt_token_ids": [int(i) for i in ids],
        "token_ids": generated,
        "top2_gaps": [round(g, 6) for g in gaps],
        "text": tokenizer.decode(generated, skip_special_tokens=True),
    }


def regenerate(
    path: Path, model: str, max_new_tokens: int, answers: Callable[[], list[dict]]
) -> None:
    """Writes the records `answers()` gives (each printed, then the time they
    took) to `path` as the exactness tests read them: under the catalogue's
    model name, the transformers and torch versions that made them, the
    dtype and the generation limit."""
    import torch
    import transformers

    t0 = time.perf_counter()
    records = answers()
    for r in records:
        print(f"{r['prompt'][:60]!r} ({len(r['prompt_token_ids'])} tokens) -> {r['text']!r}")
    print(f"{len(records)} answers in {time.perf_counter() - t0:.1f} s")
    payload = {
        "model": model,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "max_new_tokens": max_new_tokens,
        "records": records,
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")
