"""The logits a model loaded from a tiny GGUF serves, step by step."""

from __future__ import annotations

import numpy as np


def served_logits(llm, tokens: list[int]) -> np.ndarray:
    """llm's logits [len(tokens) - 3, vocab]: after prefilling tokens[:4],
    then after each of the rest, decoded one step at a time."""
    llm.manager.add("r")
    try:
        rows = [llm.engine.prefill(["r"], [tokens[:4]])[0]]
        rows += [llm.engine.decode(["r"], [t])[0] for t in tokens[4:]]
    finally:
        llm.manager.release("r")
    return np.stack(rows)
