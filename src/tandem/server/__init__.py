"""`tandem serve`: an OpenAI- and Ollama-compatible HTTP server on the batched engine.

A frontend stage above api.py (nothing below imports it): `worker.py` owns the model on its one thread and steps
the engine; `app.py` is the FastAPI application that talks to it through thread-safe queues; `protocol.py` reads
and checks the requests of both APIs."""

from __future__ import annotations

import socket
from collections.abc import Callable
from types import FrameType

from tandem.api import LLM
from tandem.errors import TandemError
from tandem.server.app import Server, create_app
from tandem.server.worker import ChatTemplate, EngineWorker

__all__ = ["ChatTemplate", "EngineWorker", "Server", "create_app", "listen", "serve"]

MAX_CONNECTIONS = 512  # open connections and requests at once (uvicorn's limit_concurrency), within ulimit's 1024


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (a one-line TandemError when it cannot be had: port taken, no such
    address), bound before the model loads."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except (OSError, OverflowError) as e:
        raise TandemError(f"cannot listen on {host}:{port} (--host/--port): {e}") from None
    return sock


def serve(
    load: Callable[[], LLM],
    sock: socket.socket,
    api_key: str | None = None,
    template: ChatTemplate | None = None,
    on_ready: Callable[[LLM], None] | None = None,
) -> None:
    """Load the model on the engine's thread, then answer HTTP on `sock` until interrupted (Ctrl-C, SIGTERM)."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # The engine stops first, so that running answers end now (with a 503 error event) and uvicorn's wait
            # for open connections is short.
            worker.stop(timeout=0)
            super().handle_exit(sig, frame)

    worker = EngineWorker(load, template)
    llm = worker.start()
    try:
        if on_ready is not None:
            on_ready(llm)
        # limit_concurrency: connections past it get a 503 at once instead of file descriptors and handlers
        config = uvicorn.Config(create_app(worker, llm, api_key), log_level="info", timeout_graceful_shutdown=5,
                                limit_concurrency=MAX_CONNECTIONS)  # fmt: skip
        _Server(config).run(sockets=[sock])
    finally:
        worker.stop()
