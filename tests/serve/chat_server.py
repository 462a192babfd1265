"""SmolLM2 served under a chat template of tests/data, an OpenAI client of
it, and streamed tool calls put together as a client does: what the
tool-call, reasoning, Responses and tokenizer tests share."""

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


def assembled(deltas) -> list[dict]:
    """The calls a stream's `tool_calls` deltas build, as OpenAI's clients
    put them together: id and name from a call's first delta, its arguments
    joined; in index order."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        delta = delta if isinstance(delta, dict) else delta.model_dump()
        call = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
        if delta.get("id"):
            assert call["id"] is None, "a call's id came twice"
            call["id"] = delta["id"]
        function = delta.get("function") or {}
        call["name"] += function.get("name") or ""
        call["arguments"] += function.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]
