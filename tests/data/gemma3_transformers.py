"""Regenerates gemma3_transformers.json: HF transformers' own greedy answers
for the Gemma 3 exactness tests, from the same GGUF pagedkv serves.

    pip install transformers accelerate gguf
    python tests/data/gemma3_transformers.py

transformers dequantizes the GGUF and builds its tokenizer from the metadata;
the model runs in float32 with its dense cache. The GGUF has no chat
template, so chat prompts are written in Gemma's documented turn format
(`CHAT_TURNS`). The prompts are short chats, raw completions, one chat
longer than the local layers' 512-token window and a long multi-turn
conversation. Each record holds the prompt's token ids, the generated ids
(stopping after `<eos>` or `<end_of_turn>`, or at the limit) and, per
generated token, the gap between the two largest logits it was chosen from
(a near-tie is where the exactness test stops comparing).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
MAX_NEW_TOKENS = 40

USER_TURN = "<start_of_turn>user\n{}<end_of_turn>\n"
MODEL_TURN = "<start_of_turn>model\n{}<end_of_turn>\n"
ANSWER = "<start_of_turn>model\n"


def chat(*turns: str) -> str:
    """Gemma's turn format: user and model turns alternating, the last a
    user's, then the model's header (the tokenizer adds `<bos>`)."""
    text = "".join(
        (USER_TURN if i % 2 == 0 else MODEL_TURN).format(turn) for i, turn in enumerate(turns)
    )
    return text + ANSWER


_FACTS = [
    "The lighthouse keeper logged the weather every morning at six.",
    "Ships passing the cape signalled with two short flashes.",
    "In winter the supply boat came only once a fortnight.",
    "The keeper's daughter painted the lamp room blue one summer.",
    "A storm in the third year broke four panes of the lantern.",
    "The logbook recorded seventeen shipwrecks over forty years.",
    "Gulls nested on the north wall each spring.",
    "The fog horn was replaced with an electric one in the last decade.",
]
LONG_STORY = " ".join(f"{fact} (Entry {i}.)" for i in range(12) for fact in _FACTS)

PROMPTS = [
    chat("What is the capital of France?"),
    chat("Write a haiku about the sea."),
    chat("List three primary colors."),
    chat("Explain in one sentence what a cache is."),
    "The quick brown fox",
    "Once upon a time, in a small village by the river,",
    "def fibonacci(n):\n",
    chat(f"Read this log and answer.\n\n{LONG_STORY}\n\nWhat did the keeper's daughter paint?"),
    chat(
        "Hi! I am planning a trip to Japan in April.",
        "That sounds wonderful! April is cherry blossom season in Japan.",
        "Which cities should I visit first?",
        "Tokyo and Kyoto are the classic pair: Tokyo for the modern city, Kyoto for temples.",
        "How many days would you spend in each?",
        "Four days in Tokyo and three in Kyoto make a relaxed first visit.",
        f"Here are my notes so far: {LONG_STORY[:2600]} Now, what should I pack?",
    ),
]


def gguf_file() -> Path:
    from pagedkv.models.fetch import fetch_gguf

    return fetch_gguf("gemma3-270m")


def transformers_answers(prompts: list[str], max_new_tokens: int = MAX_NEW_TOKENS) -> list[dict]:
    """transformers' greedy float32 continuations of `prompts`: prompt ids,
    generated ids, top-two logit gaps and text."""
    from hf_greedy import greedy_record, load_float32

    tokenizer, model = load_float32(gguf_file())
    stop = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    return [
        greedy_record(
            model,
            tokenizer,
            prompt,
            tokenizer(prompt)["input_ids"],
            max_new_tokens,
            stop,
            tokenizer.pad_token_id,
        )
        for prompt in prompts
    ]


def main() -> None:
    from hf_greedy import regenerate

    regenerate(
        HERE / "gemma3_transformers.json",
        "gemma3-270m",
        MAX_NEW_TOKENS,
        lambda: transformers_answers(PROMPTS),
    )


if __name__ == "__main__":
    main()
