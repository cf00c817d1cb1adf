"""``sart serve``'s loading of its engine and PRM (``sart.serve.command.backend_loader``,
which is ``sart.launch.load``): what runs on which thread, with the model loads
themselves stood in for."""

from __future__ import annotations

import importlib.util
import sys
import threading
from typing import Any

import pytest

import sart.errors
import sart.launch
import sart.registry
from sart.cli import _parser
from sart.serve import command


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """``(what, thread name)`` of every import and load ``backend_loader`` makes."""
    log: list[tuple[str, str]] = []

    def note(what: str, result: Any = None) -> Any:
        log.append((what, threading.current_thread().name))
        return result

    monkeypatch.setattr(sart.registry, "load_prm", lambda name: note(f"import prm {name}"))
    monkeypatch.setattr(sart.launch, "build_engine", lambda spec: note("engine", object()))
    monkeypatch.setattr(sart.launch, "build_prm", lambda spec: note("prm", object()))
    return log


def load(*flags: str) -> None:
    args = _parser().parse_args(["serve", "--model", "testbed", *flags])
    command.backend_loader(command.load_spec_of(args))()


def test_the_prm_module_is_imported_before_the_prm_process_starts_on_its_thread(
    calls: list[tuple[str, str]],
) -> None:
    # transformers 5 is not safe to import from two threads at once: the PRM's
    # module is imported on the caller's thread, which builds the engine, before
    # the PRM's thread starts (to start the PRM's process, importing nothing).
    load()
    main = threading.current_thread().name
    assert calls[0] == ("import prm qwen", main)
    assert sorted(calls[1:]) == [("engine", main), ("prm", "sart-prm-load_0")]


def test_a_prm_loaded_in_this_process_loads_after_the_engine_on_this_thread(
    calls: list[tuple[str, str]],
) -> None:
    load("--prm-in-process")
    main = threading.current_thread().name
    assert calls == [
        ("import prm qwen", main),
        ("engine", main),
        ("prm", main),
    ]


def test_equivalence_picks_how_the_servers_votes_group_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def config(*flags: str) -> Any:
        args = _parser().parse_args(["serve", "--model", "testbed", *flags])
        command.load_spec_of(args)  # resolves args.model, as the command does first
        return command.serve_config(args, has_prm=True)

    assert config().equivalence is None  # the methods' own: exact strings
    if importlib.util.find_spec("math_verify") is not None:
        chosen = config("--equivalence", "math-verify").equivalence
        assert type(chosen).__name__ == "MathVerifyEquivalence"
    # Without the eval extra the server refuses at start, naming what to install.
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(sart.errors.MissingDependencyError, match=r"\.\[eval\]"):
        config("--equivalence", "math-verify")
    with pytest.raises(SystemExit):
        config("--equivalence", "sympy")


def test_flags_left_out_take_and_show_the_defaults_of_the_config_classes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The flags once repeated the classes' defaults as literals (300 s upstream timeout,
    # 60 s PRM timeout, B = 64, ...), in their defaults and their help: a default moved in
    # its class and not on the command line would be served, and said, wrongly. With the
    # classes' defaults moved, the flags follow them.
    import attrs

    from sart import model_flags
    from sart.launch import Gateway, LoadSpec
    from sart.serve import http_flags
    from sart.serve.config import ServeConfig

    @attrs.frozen
    class MovedServe(ServeConfig):
        max_n: int = 31
        batch_size: int = 48
        shutdown_grace: float = 2.5
        max_body_bytes: int = 1 << 21
        stream_interval: int = 4

    @attrs.frozen
    class MovedGateway(Gateway):
        stream_interval: int = 3
        stream_timeout: float = 120.0

    @attrs.frozen
    class MovedSpec(LoadSpec):
        prm_timeout: float = 7.5

    monkeypatch.setattr(command, "ServeConfig", MovedServe)
    monkeypatch.setattr(http_flags, "ServeConfig", MovedServe)
    monkeypatch.setattr(command, "Gateway", MovedGateway)
    monkeypatch.setattr(model_flags, "LoadSpec", MovedSpec)
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--help"])
    helped = " ".join(capsys.readouterr().out.split())
    for said in (
        "the most branches per request (31)",
        "branch budget B, over all requests (48)",
        "answered 503 (2.5)",
        "largest request body (default 2 MiB;",
        "stream_interval; default 3: every token",
        "as vLLM's (default 4; 1: every token)",
        "before it fails (default 120):",
        "check before the check fails (default 7.5)",
    ):
        assert said in helped

    args = _parser().parse_args(["serve", "--model", "m", "--engine", "openai"])
    args.upstream = ["http://127.0.0.1:9"]
    config = command.serve_config(args, has_prm=False)
    assert (config.max_n, config.batch_size, config.shutdown_grace) == (31, 48, 2.5)
    assert config.stream_interval == 4
    # A spec without a PRM refuses a PRM setting other than LoadSpec's own default.
    monkeypatch.setattr(model_flags, "LoadSpec", LoadSpec)
    gateway = command.load_spec_of(args).gateway
    assert gateway is not None
    assert (gateway.stream_interval, gateway.stream_timeout) == (3, 120.0)
    monkeypatch.setattr(model_flags, "LoadSpec", MovedSpec)
    args = _parser().parse_args(["serve", "--prm-url", "http://127.0.0.1:9", "--prm", "tok"])
    assert command.load_spec_of(args).prm_timeout == 7.5
