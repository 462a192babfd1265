"""SmolLM2 served under a chat template of tests/data, and an OpenAI client
of it: what the tool-call, reasoning, Responses and tokenizer tests share."""

from __future__ import annotations

import contextlib
from pathlib import Path

import openai

from pagedkv.models import load
from pagedkv.serve import ServerThread

MODEL = "smollm2-135m-instruct"
DATA = Path(__file__).parent.parent / "data"


@contextlib.contextmanager
def chat_server(template: str | None = None):
    """A started server of MODEL under tests/data/`template` (the GGUF's own
    chat template when None)."""
    chat_template = (DATA / template).read_text() if template else None
    with ServerThread(load(MODEL, chat_template=chat_template)) as server:
        yield server


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
