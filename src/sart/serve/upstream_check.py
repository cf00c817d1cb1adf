"""Before a gateway (``sart serve --engine openai``) serves: its upstreams asked for the
models they serve (``GET /v1/models``), so that a wrong URL, key or model stops the
command with a line saying what to fix, rather than a server whose ``/health`` says
200 while every request fails. One upstream that does not answer yet is a warning:
the others take its requests until it does. An answer's faults are worded as the
gateway's ``/health`` words them (``sart.engines.openai_wire.model_ids``), with what to
do about each.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from sart.errors import ConfigError

UPSTREAM_KEY_ENV = "SART_UPSTREAM_API_KEY"
"""The upstreams' API key when ``--upstream-api-key`` is not given."""


class _Unreachable(ConfigError):
    """Nothing answers at an upstream's address."""


def _upstream_models(url: str, api_key: str | None) -> list[str]:
    """The models ``url``'s ``/v1/models`` lists, or a ``ConfigError`` saying what to fix
    (``_Unreachable`` where nothing answers)."""
    import httpx

    from sart.engines.openai_wire import ModelListFault, model_ids
    from sart.engines.openai_wire import base_url as _base

    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--upstream {url}: give its scheme, as in http://{url}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(_base(url) + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        if "SSL" in str(exc) and url.startswith("https://"):
            # Something answered, in plain HTTP (ssl's WRONG_VERSION_NUMBER).
            raise ConfigError(
                f"--upstream {url}: it does not speak TLS ({exc}); give it as "
                f"http://{url.removeprefix('https://')}"
            ) from None
        raise _Unreachable(
            f"--upstream {url}: nothing answers there ({exc or type(exc).__name__}); is the "
            "server up, at this host and port?"
        ) from None
    try:
        return model_ids(response)
    except ModelListFault as fault:  # in the words /health says it in, and what to do
        raise ConfigError(f"--upstream {url}: {fault}{_REMEDIES.get(fault.kind, '')}") from None


_REMEDIES = {
    "key": f"; give its API key with --upstream-api-key KEY (or {UPSTREAM_KEY_ENV})",
    "http": "; is it an OpenAI-compatible server (vllm serve, SGLang's launch_server), named "
    "by its base URL (http://host:port)?",
    "malformed": "; is it an OpenAI-compatible server (vllm serve, SGLang's launch_server)?",
}
"""What to do about a fault of an upstream's ``/v1/models`` (``ModelListFault.kind``)."""


def upstream_model(url: str, api_key: str | None) -> str:
    """The first model ``url``'s ``/v1/models`` lists (``--model`` left out)."""
    try:
        return _upstream_models(url, api_key)[0]
    except _Unreachable as exc:
        raise ConfigError(f"{exc} (without --model, the gateway asks it for its model)") from None


def check_upstreams(urls: Sequence[str], api_key: str | None, model: str) -> None:
    """Before the gateway serves: every upstream that answers must serve ``model`` (a
    request sent to one that does not would fail, as would every request to a gateway
    whose upstreams are all down, while its /health said 200). One that does not answer
    yet is a warning: the others take its requests until it does."""
    from sart.engines.openai_wire import ModelListFault, served

    down = []
    for url in urls:
        try:
            models = _upstream_models(url, api_key)
        except _Unreachable as exc:
            down.append(str(exc))
            continue
        try:
            served(models, model)
        except ModelListFault as fault:
            raise ConfigError(
                f"--upstream {url}: {fault}: give --model one of them (left out, it is the "
                "first upstream's)"
            ) from None
    if len(down) == len(urls):
        raise ConfigError("no --upstream answers: " + "; ".join(down))
    for reason in down:
        print(f"sart serve: warning: {reason}", file=sys.stderr)


__all__ = ["UPSTREAM_KEY_ENV", "check_upstreams", "upstream_model"]
