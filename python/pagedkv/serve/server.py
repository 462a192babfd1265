"""Running the app: `serve()` blocks in uvicorn (the CLI), `ServerThread`
runs it on a background thread (tests and benchmarks).

Both own the engine's lifetime: it starts before the first request and is
stopped, failing what is still queued, after uvicorn stops accepting.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

import uvicorn

from .app import create_app
from .engine import ServingEngine
from .limits import ServeLimits
from .metrics import ServeMetrics


def build(
    llm,
    api_key: str | None = None,
    limits: ServeLimits | None = None,
    allowed_origins: Sequence[str] = (),
    served_model_names: Sequence[str] = (),
    **engine_options,
):
    """(app, engine, metrics): a started engine over `llm` and its app,
    which serves it as `served_model_names` (default: its own name)."""
    metrics = ServeMetrics()
    engine = ServingEngine(llm, observer=metrics, **engine_options)
    metrics.bind(engine)
    engine.start()
    names = tuple(served_model_names) or llm.name
    app = create_app(engine, names, api_key, metrics, limits, allowed_origins)
    return app, engine, metrics


def serve(
    llm,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key=None,
    limits=None,
    allowed_origins: Sequence[str] = (),
    served_model_names: Sequence[str] = (),
    shutdown_timeout: float = 5.0,
    **engine_options,
) -> None:
    """Serves `llm` until interrupted (SIGINT or SIGTERM): then it stops
    accepting, lets the requests in flight finish for up to
    `shutdown_timeout` seconds, cuts the rest and stops the engine.

    Examples
    --------
    >>> serve(pagedkv.models.load(), port=8000)  # doctest: +SKIP
    """
    app, engine, _ = build(
        llm, api_key, limits, allowed_origins, served_model_names, **engine_options
    )
    try:
        uvicorn.run(
            app,
            host=host,
            port=port,
            log_level="info",
            timeout_graceful_shutdown=shutdown_timeout,
        )
    finally:
        engine.stop()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """The server on a loopback port in a background thread.

    Examples
    --------
    >>> with ServerThread(llm) as server:  # doctest: +SKIP
    ...     openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(
        self,
        llm,
        host: str = "127.0.0.1",
        port: int | None = None,
        api_key=None,
        limits=None,
        allowed_origins: Sequence[str] = (),
        served_model_names: Sequence[str] = (),
        **engine_options,
    ):
        self.app, self.engine, self.metrics = build(
            llm, api_key, limits, allowed_origins, served_model_names, **engine_options
        )
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="pagedkv-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self.engine.stop()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
