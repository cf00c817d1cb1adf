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
