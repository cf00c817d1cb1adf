"""The defaults a served model gives the requests that leave sampling unset: its
generation config (``sart.generation_config``, ``--generation-config``,
``--override-generation-config``) under the flags of ``sart serve`` that set them.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import attrs

from sart.engines.base import unhonoured_sampling
from sart.errors import ConfigError
from sart.generation_config import AUTO, OWN, generation_defaults
from sart.serve.config import ServeConfig
from sart.types import EXTRA_SAMPLING, SamplingSettings


def within(max_tokens: int, limit: int | None) -> int:
    """``max_tokens``, lowered to ``limit`` where one is given."""
    return max_tokens if limit is None else min(max_tokens, limit)


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object (``--override-generation-config``)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def with_model_defaults(config: ServeConfig, args: argparse.Namespace) -> ServeConfig:
    """``config`` with the defaults of the model's generation config
    (``--generation-config``, ``--override-generation-config``: see
    ``sart.generation_config``) where no flag set them: temperature, top_p and
    max_tokens (also the limit, where ``--max-tokens-limit`` is not given), and the
    ``EXTRA_SAMPLING`` fields. Read once the engine has loaded: a hub model's file is
    in the cache then."""
    found = generation_defaults(
        args.generation_config,
        args.tokenizer or args.model,
        args.override_generation_config,
    )
    given = {"temperature": args.temperature, "top_p": args.top_p, "max_tokens": args.max_tokens}
    changes: dict[str, Any] = {
        key: value for key, value in found.items() if key in given and given[key] is None
    }
    if "max_tokens" in changes:
        changes["max_tokens"] = within(changes["max_tokens"], args.max_tokens_limit)
        changes["max_tokens_limit"] = args.max_tokens_limit or changes["max_tokens"]
    changes["sampling"] = {key: v for key, v in found.items() if key in EXTRA_SAMPLING}
    return attrs.evolve(config, **changes)


def check_honoured(config: ServeConfig, engine: Any, name: str) -> None:
    """Refuses defaults the engine does not honour: every request would be refused."""
    unhonoured = unhonoured_sampling(engine, SamplingSettings(**config.sampling))
    if unhonoured:
        raise ConfigError(
            f"generation_config={unhonoured}: --engine {name} does not honour these; "
            "--generation-config sart, or --override-generation-config giving them null, "
            "serves without them"
        )


def check_named(args: argparse.Namespace) -> None:
    """Checks a generation config named by path (``--generation-config DIR``) and the
    override, before the models load; the model's own is read once they have
    (``with_model_defaults``: a hub model's file is in the cache then)."""
    source = OWN if args.generation_config == AUTO else args.generation_config
    generation_defaults(source, None, args.override_generation_config)
