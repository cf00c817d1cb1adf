"""``sart serve``: SART behind an OpenAI-compatible HTTP API.

Any OpenAI client calls it; each request runs with the policy its body names
(``extra_body={"method": "sart", "n": 8}``) and gets the chosen branch back,
with every branch's outcome in a ``sart`` field. See
``docs/tutorials/serve.md``.

One module per job:

- ``config``: what the server fixes at start: ``ServeConfig`` (names,
  defaults, limits, access) and ``Backend`` (the engine and PRM it serves);
- ``methods``: the methods and selectors a request may name
  (``register_method``);
- ``protocol``: request and response shapes, the meaning of ``n``;
- ``engine``: ``ServingEngine``, any engine as the asyncio driver awaits it,
  with cancellation;
- ``service``: ``Service``, the driver with admission, cancellation, results;
- ``metrics``: the ``sart:`` Prometheus metrics;
- ``app``: the FastAPI app (``create_app``), access, disconnects, streaming;
- ``events``: a streamed answer's server-sent events (a one-branch request's
  as it is made);
- ``http_server``: uvicorn's server, draining requests before it closes;
- ``command``: the ``sart serve`` command line (``http_flags``: its HTTP flags).

``import sart.serve`` needs nothing beyond sart itself (plugins register
methods with it); ``create_app`` needs the ``[serve]`` extra (FastAPI,
uvicorn, prometheus-client).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sart.errors import MissingDependencyError, install_hint
from sart.serve.config import Backend, ServeConfig
from sart.serve.methods import SELECTORS, method_names, register_method

#: Top-level modules of the ``[serve]`` extra.
SERVE_MODULES = frozenset({"fastapi", "starlette", "pydantic", "uvicorn", "prometheus_client"})


def create_app(config: ServeConfig, backend: Backend | Callable[[], Backend]) -> Any:
    """The server's FastAPI app: ``config`` fixed, ``backend`` served (a function that
    builds it is called when the app starts, on its event loop). Serve it with any
    ASGI server (``sart serve`` runs uvicorn)."""
    try:
        from sart.serve.app import create_app as create
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in SERVE_MODULES:
            raise
        needs = f"sart serve needs {exc.name}: {install_hint('serve')}"
        raise MissingDependencyError(needs) from exc
    return create(config, backend)


__all__ = ["SELECTORS", "Backend", "ServeConfig", "create_app", "method_names", "register_method"]
