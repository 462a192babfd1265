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
    from hf_greedy import greedy_record, load_float32
    from pagedkv.models.fetch import fetch_gguf

    tokenizer, model = load_float32(fetch_gguf("smollm2-135m-instruct"))
    records = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):
            ids = list(ids["input_ids"])
        eos = tokenizer.eos_token_id
        records.append(greedy_record(model, tokenizer, prompt, ids, MAX_NEW_TOKENS, eos, eos))
    return records


def main() -> None:
    from hf_greedy import regenerate

    regenerate(
        HERE / "smollm2_transformers.json",
        "smollm2-135m-instruct",
        MAX_NEW_TOKENS,
        lambda: transformers_answers(PROMPTS),
    )


if __name__ == "__main__":
    main()
