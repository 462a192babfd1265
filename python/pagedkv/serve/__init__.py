"""`pagedkv serve`: an OpenAI-compatible HTTP server over the paged cache.

engine.py schedules (one thread owns the manager and step graphs), app.py
speaks OpenAI's API (FastAPI), metrics.py exports Prometheus text,
server.py runs it under uvicorn. docs/serving.md describes the design.
"""

from .engine import GenerationRequest, QueueFullError, RequestError, ServingEngine
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
