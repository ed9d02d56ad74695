"""`BackgroundServer`: an ASGI app served by uvicorn in a daemon thread, for tests, benchmarks and notebooks.

It listens on a port the OS picks on 127.0.0.1 (never another address): the socket is bound here first, so
the port is known before the server starts and no other process can take it. It imports no phase: the
caller hands it the app (phase 5.6's `create_app`).
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

LOCALHOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 30
SHUTDOWN_TIMEOUT_S = 15
GRACEFUL_SHUTDOWN_S = 2  # open streams get this long to finish before uvicorn cancels them
STARTUP_POLL_S = 0.02


class BackgroundServer:
    """`with BackgroundServer(app) as srv:` ... `srv.base_url` is `http://127.0.0.1:<port>/v1`."""

    def __init__(self, app, log_level: str = "warning"):
        self.app = app
        self.log_level = log_level
        self.port: int | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def __enter__(self) -> "BackgroundServer":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOCALHOST, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=self.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=f"uvicorn-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"the server did not start on {self.url} within {STARTUP_TIMEOUT_S} s")
            time.sleep(STARTUP_POLL_S)
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(SHUTDOWN_TIMEOUT_S)
