"""What ``sart bench``, ``sart eval`` and ``sart serve`` share: one method registry and one
model loader. A method a ``--plugin`` module registers runs through all three; a flag
the chosen engine (or PRM) would ignore is refused by all three, before anything loads;
``sart serve`` depends on neither the benchmark nor the simulator."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import sart.methods
import sart.registry
from sart.cli import main

PLUGIN = '''
"""A toy method: the first branch to finish answers (no PRM)."""
import sart
from sart.methods import register_method


def first_done(n, interval):
    return sart.Policy(n=n, stop=sart.FirstM(1), prune=sart.NoPrune(),
                       select=sart.MajorityVote(), interval=interval, name=f"first-done(n={n})")


register_method("first-done", first_done, label="First done", short_label="First",
                rewards="none")
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A plugin module ``toy_methods`` on the path; the registry as it was afterwards."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "toy_methods.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(sart.methods, "_METHODS", dict(sart.methods._METHODS))
    yield folder
    sys.modules.pop("toy_methods", None)


def test_a_plugin_method_is_benchmarked_in_the_simulator(plugin: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "--plugin", "toy_methods", "--methods", "first-done", "sc", "--n", "4"]
    argv += ["--rate", "4", "--requests", "20", "--no-plots", "--out", str(out), "--json"]
    assert main(argv) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    summary = {run["method"]: run for run in runs}
    assert summary["first-done"]["label"] == "First done"
    # The first of four branches to finish ends the request: fewer tokens than SC.
    tokens = {m: summary[m]["summary"]["tokens_per_request"] for m in summary}
    assert tokens["first-done"] < 0.75 * tokens["sc"]


def test_a_method_is_refused_until_its_plugin_registers_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--methods", "first-done", "--no-plots"])
    assert "--methods 'first-done' must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--plugin", "no_such_plugin_module"])
    assert "--plugin no_such_plugin_module: cannot import it" in capsys.readouterr().err


def test_a_plugin_method_is_evaluated_on_the_testbed(plugin: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "eval"
    argv = ["eval", "--plugin", "toy_methods", "--dataset", "testbed", "--limit", "4"]
    argv += ["--model", "testbed", "--n", "4", "--prm-in-process", "--rate", "20"]
    argv += ["--methods", "first-done", "sc", "--out", str(out), "--no-plots", "--json"]
    assert main(argv) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert {(r["method"], r["n"]) for r in runs} >= {("first-done", 4), ("sc", 4)}
    first = next(r for r in runs if r["method"] == "first-done" and r["n"] == 4)
    assert first["label"] == "First done" and len(first["requests"]) == 4


def test_a_plugin_method_is_served(plugin: Path) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("transformers")
    from sart import testbed
    from serving import KEY, Server

    server = Server("--plugin", "toy_methods", "--api-key", KEY, env={"PYTHONPATH": str(plugin)})
    try:
        client = server.client()
        models = client.models.list()
        assert "first-done" in models.data[0].model_extra["sart"]["methods"]
        prompt = testbed.make_questions(3, 1)[0].prompt
        extra = {"method": "first-done", "n": 4}
        reply = client.completions.create(model="testbed", prompt=prompt, extra_body=extra)
        outcome = reply.model_extra["sart"]
        assert outcome["policy"] == "first-done(n=4)"
        assert sum(b["status"] == "finished" for b in outcome["branches"]) >= 1
    finally:
        code, log = server.stop()
    assert code == 0, log


PROMPTS = '{"prompt": "Q p1 3 S", "answer": "3"}\n'


ADAPTERS = '''
"""A toy engine and a toy PRM, as a plugin author writes them: a class with
from_spec(spec), registered by name (here, wrappers of sart's transformers adapters)."""
from sart.engines.hf import HFEngine
from sart.prm.hf import QwenMathPRM
from sart.registry import register_engine, register_prm

BUILT = []


class ToyEngine(HFEngine):
    @classmethod
    def from_spec(cls, spec):
        BUILT.append(("engine", spec.engine))
        return cls.from_pretrained(spec.model, device="cpu")


class ToyPRM(QwenMathPRM):
    @classmethod
    def from_spec(cls, spec):
        BUILT.append(("prm", spec.prm_kind))
        return cls.from_pretrained(spec.prm, device="cpu", **spec.prm_options)


register_engine("toy", ToyEngine)
register_prm("toy-prm", ToyPRM)
'''


@pytest.fixture
def adapters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A plugin module ``toy_adapters`` on the path; the registries as they were after."""
    pytest.importorskip("transformers")
    folder = tmp_path / "adapters"
    folder.mkdir()
    (folder / "toy_adapters.py").write_text(ADAPTERS)
    monkeypatch.syspath_prepend(str(folder))
    for table in ("_ENGINES", "_PRMS", "_ENGINE_BUILDERS", "_PRM_BUILDERS", "_STREAMING"):
        monkeypatch.setattr(
            sart.registry, table, type(getattr(sart.registry, table))(getattr(sart.registry, table))
        )
    yield folder
    sys.modules.pop("toy_adapters", None)


TOY = ["--plugin", "toy_adapters", "--engine", "toy", "--prm-kind", "toy-prm"]


def test_a_plugin_engine_and_prm_are_benchmarked_by_name(adapters: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    argv = ["bench", *TOY, "--model", "testbed", "--methods", "sart", "--n", "2"]
    argv += ["--rate", "20", "--requests", "3", "--no-plots", "--out", str(out), "--json"]
    assert main(argv) == 0
    import toy_adapters

    assert toy_adapters.BUILT[:2] == [("engine", "toy"), ("prm", "toy-prm")]
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["method"] == "sart" and run["summary"]["requests"] == 3


def test_a_plugin_engine_and_prm_evaluate_by_name(adapters: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    argv = ["eval", *TOY, "--dataset", "testbed", "--limit", "3", "--model", "testbed"]
    argv += ["--n", "2", "--rate", "20", "--methods", "sart", "--out", str(out), "--no-plots"]
    assert main([*argv, "--json"]) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["method"], r["n"], len(r["requests"])) for r in runs] == [("sart", 2, 3)]


def test_a_plugin_engine_and_prm_are_served_by_name(adapters: Path) -> None:
    pytest.importorskip("fastapi")
    from sart import testbed
    from serving import KEY, Server

    server = Server(*TOY, "--api-key", KEY, env={"PYTHONPATH": str(adapters)})
    try:
        prompt = testbed.make_questions(3, 1)[0].prompt
        extra = {"method": "sart", "n": 2}
        reply = server.client().completions.create(model="testbed", prompt=prompt, extra_body=extra)
        assert reply.model_extra["sart"]["policy"].startswith("sart")
    finally:
        code, log = server.stop()
    assert code == 0, log


def test_an_engine_no_plugin_registered_is_refused_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--engine", "toy", "--model", "testbed", "--no-plots"])
    assert "--engine 'toy' must be one of ['sim', 'hf', 'sglang', 'vllm']" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main(["serve", "--model", "testbed", "--prm-kind", "toy-prm"])
    assert "--prm-kind 'toy-prm' must be one of" in capsys.readouterr().err


def _every_command(tmp_path: Path, *flags: str) -> dict[str, list[str]]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(PROMPTS)
    out = str(tmp_path / "out")
    return {
        "bench": ["bench", "--model", "testbed", "--prompts", str(prompts), "--out", out, *flags],
        "eval": ["eval", "--dataset", "testbed", "--model", "testbed", "--out", out, *flags],
        "serve": ["serve", "--model", "testbed", *flags],
    }


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--engine", "vllm", "--device", "cuda:0"], "--device has no effect with --engine vllm"),
        (["--engine", "vllm", "--cuda-graphs"], "--cuda-graphs has no effect with --engine vllm"),
        (["--engine", "hf", "--cuda-graphs"], "--device 'cpu' must be a CUDA device"),
        (["--engine", "hf", "--sglang-arg", "tp_size=2"], "--sglang-arg has no effect with"),
        (["--engine", "hf", "--vllm-arg", "dtype=half"], "--vllm-arg has no effect with"),
        (
            ["--engine", "hf", "--prm", "p", "--prm-kind", "vllm-qwen", "--prm-device", "cuda"],
            "--prm-device has no effect with --prm-kind vllm-qwen (it is for --prm-kind qwen "
            "or shepherd)",
        ),
        (
            ["--engine", "vllm", "--prm", "p", "--prm-kind", "vllm-qwen", "--prm-in-process"],
            "--prm-in-process has no effect with --prm-kind vllm-qwen",
        ),
    ],
)
def test_a_flag_the_engine_would_ignore_is_refused_by_every_command(
    tmp_path: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for command, argv in _every_command(tmp_path, *flags).items():
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2, command
        assert message in capsys.readouterr().err, command


def test_sart_serve_imports_neither_the_benchmark_nor_the_simulator() -> None:
    code = (
        "import sys, sart.serve.command, sart.serve.methods, sart.launch, sart.flags; "
        "print(sorted(m for m in sys.modules if m.startswith(('sart.bench', 'sart.eval')) "
        "or m == 'sart.engines.sim'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
