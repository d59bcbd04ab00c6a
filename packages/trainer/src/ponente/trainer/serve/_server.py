"""Running the app with uvicorn: in the foreground (``ponente-serve``) or on a background thread (tests, notebooks)."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any

from ._app import require_serve_extra

__all__ = ["MAX_CONNECTIONS", "ServerThread", "free_port", "serve"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


MAX_CONNECTIONS = 512
"""Open connections (and requests in progress) at most, by default; uvicorn answers 503 beyond."""


def serve(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    max_connections: int = MAX_CONNECTIONS,
) -> None:
    """Serve ``app`` with uvicorn until interrupted (Ctrl-C or SIGTERM).

    Args:
        app: the app of :func:`create_app`.
        host: the address to listen on (``0.0.0.0``: every interface).
        port: the TCP port.
        log_level: uvicorn's log level.
        max_connections: concurrent connections at most (uvicorn's ``limit_concurrency``: 503 beyond).

    Raises:
        ImportError: if the ``serve`` extra is not installed.
    """
    require_serve_extra()
    import uvicorn

    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=30,
        limit_concurrency=max_connections,
    )


class ServerThread:
    """A uvicorn server on a background thread, as a context manager: started on enter, stopped on exit.

    Args:
        app: the app of :func:`create_app`.
        host: the address to listen on.
        port: the TCP port (None: a free one).
        log_level: uvicorn's log level.
        startup_timeout_s: how long :meth:`start` waits for the server to accept connections.
        max_connections: concurrent connections at most (503 beyond).

    Example:
        ```python
        with ServerThread(create_app(engine, tokenizer)) as server:
            client = openai.OpenAI(base_url=server.base_url, api_key="unused")
            client.completions.create(model="ponente", prompt="Hello", max_tokens=8)
        ```
    """

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_level: str = "warning",
        startup_timeout_s: float = 60.0,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        require_serve_extra()
        import uvicorn

        self.host = host
        self.port = free_port(host) if port is None else port
        self.startup_timeout_s = startup_timeout_s
        config = uvicorn.Config(
            app,
            host=host,
            port=self.port,
            log_level=log_level,
            timeout_graceful_shutdown=5,
            limit_concurrency=max_connections,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="ponente-serve-uvicorn", daemon=True)

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``, the ``base_url`` of an OpenAI client."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> ServerThread:
        """Start serving and wait until the server accepts connections; returns ``self``.

        Raises:
            RuntimeError: if the server has not started within ``startup_timeout_s`` (or failed to).
        """
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.host}:{self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Ask the server to shut down and wait for its thread."""
        self._server.should_exit = True
        self._thread.join(30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
