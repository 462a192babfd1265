"""Regenerates smollm2_transformers.json: HF transformers' own greedy answers
to the exactness test's chat prompts, from the same GGUF pagedkv serves.

    pip install transformers accelerate gguf
    python tests/data/smollm2_transformers.py

transformers dequantizes the GGUF, builds its tokenizer from the metadata and
applies the chat template; the model runs in float32 with its dense cache.
Each record holds the prompt's token ids, the generated ids (stopping after
EOS or at the limit) and, per generated token, the gap between the two
largest logits it was chosen from (a near-tie is where the exactness test
stops comparing).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a KV cache is.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to play the guitar.",
    "Why is the sky blue?",
    "Name a famous painting by Leonardo da Vinci.",
    "What should I cook for dinner tonight?",
]
MAX_NEW_TOKENS = 48
HERE = Path(__file__).parent


def transformers_answers(prompts: list[str]) -> list[dict]:
    """transformers' greedy float32 answers to `prompts` (chat template
    applied): prompt ids, generated ids, top-two logit gaps and text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedkv.models.fetch import fetch_gguf

    gguf = fetch_gguf("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.eval()
    records = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):
            ids = list(ids["input_ids"])
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )
        generated = out.sequences[0, len(ids) :].tolist()
        gaps = []
        for step_logits in out.logits[: len(generated)]:
            top2 = torch.topk(step_logits[0].double(), 2).values
            gaps.append(float(top2[0] - top2[1]))
        records.append(
            {
                "prompt": prompt,
                "prompt_token_ids": [int(i) for i in ids],
                "token_ids": generated,
                "top2_gaps": [round(g, 6) for g in gaps],
                "text": tokenizer.decode(generated, skip_special_tokens=True),
            }
        )
    return records


def main() -> None:
    import torch
    import transformers

    t0 = time.perf_counter()
    records = transformers_answers(PROMPTS)
    for r in records:
        print(f"{r['prompt']!r} -> {r['text']!r}")
    print(f"{len(records)} answers in {time.perf_counter() - t0:.1f} s")
    payload = {
        "model": "smollm2-135m-instruct",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "max_new_tokens": MAX_NEW_TOKENS,
        "records": records,
    }
    (HERE / "smollm2_transformers.json").write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
