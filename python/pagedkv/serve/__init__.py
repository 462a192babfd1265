"""`pagedkv serve`: an OpenAI-compatible HTTP server over the paged cache.

engine.py schedules (one thread owns the manager and step graphs), app.py
speaks OpenAI's API (FastAPI), metrics.py exports Prometheus text,
server.py runs it under uvicorn. docs/serving.md describes the design.

The HTTP side needs the ``serve`` extra (``pip install -e ".[serve]"``):
`ServerThread`, `build` and `serve` import it when first named, so that
the rest of the package (and the `pagedkv` command) works without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .engine import GenerationRequest, QueueFullError, RequestError, ServingEngine

if TYPE_CHECKING:
    from .server import ServerThread, build, serve

__all__ = [
    "GenerationRequest",
    "QueueFullError",
    "RequestError",
    "ServerThread",
    "ServingEngine",
    "build",
    "serve",
]

_FROM_SERVER = ("ServerThread", "build", "serve")


def __getattr__(name: str):
    if name in _FROM_SERVER:
        return getattr(importlib.import_module(".server", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
