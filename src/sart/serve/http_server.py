"""``DrainingServer``: uvicorn's server, which lets sart's requests end before it closes;
``log_config``: uvicorn's logging, with sart's loggers beside its own.

uvicorn alone, told to stop (SIGTERM, Ctrl-C), waits its grace period for the
handlers in flight, then cancels those still running: their clients got a bare
``500 Internal Server Error`` in plain text (not OpenAI's error shape) or a
stream cut short with no error event, and the log a traceback per request.
``DrainingServer`` first closes its listening sockets, then drains the service
(``Service.drain``: each request in flight finishes, or after
``ServeConfig.shutdown_grace`` is cancelled, its branches aborted, and
answered 503), then shuts down as uvicorn does. A second Ctrl-C cuts the drain
short, as it cuts uvicorn's own wait.

Needs uvicorn (the ``[serve]`` extra); ``sart serve`` imports it once the extra
is known to be there.
"""

from __future__ import annotations

import asyncio
import copy
import socket
from typing import Any

import uvicorn


class DrainingServer(uvicorn.Server):
    """Serves ``app`` (sart's FastAPI app, ``create_app``) as ``config`` says; see the
    module docstring."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self.sart_app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for listener in self.servers:
            listener.close()  # no new connections while draining
        service = getattr(self.sart_app.state, "service", None)  # None: never started
        if service is not None:
            drain = asyncio.ensure_future(service.drain(self.sart_app.state.config.shutdown_grace))
            while not drain.done() and not self.force_exit:
                await asyncio.wait({drain}, timeout=0.1)
            if not drain.done():
                drain.cancel()
        await super().shutdown(sockets)


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging config, with sart's loggers (``sart.serve``: a request that
    failed, timed out or was cancelled; ``sart.prm``: the PRM's process restarted) on
    its stderr handler at ``level`` (``--log-level``). Without them, sart's lines went
    to Python's last-resort handler: without a level, unlike uvicorn's lines around
    them, and at WARNING whatever ``--log-level`` said."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["sart"] = {
        "handlers": ["default"],
        "level": level.upper(),
        "propagate": False,
    }
    return config
