"""transformers' greedy float32 continuation of one prompt, as the record
the exactness tests compare: shared by the reference scripts beside it."""

from __future__ import annotations


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
