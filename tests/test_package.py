"""The package surface: import cost, exported names, the command line."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import sart
import sart.testing
from sart.cli import main


def test_import_sart_loads_no_engine_or_torch() -> None:
    code = (
        "import sart, sart.testing, sys; "
        "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'sglang', 'numpy') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


#: The pure core: it decides, never acts, and knows no adapter (docs/architecture.md);
#: and the drivers, which act through the engine and PRM contracts only.
CORE = (
    "scheduler", "commands.py", "state.py", "views.py", "messages.py", "policies",
    "methods.py", "rewards", "confidence", "driver.py", "sync_driver.py", "async_driver.py",
    "score_runner.py", "servable.py",
)  # fmt: skip
#: The contracts (protocols and their helpers), which the drivers may import.
CONTRACTS = ("sart.engines.base", "sart.prm.base")


def test_the_core_imports_no_adapter_module() -> None:
    root = Path(sart.__file__).parent
    files = [
        p
        for name in CORE
        for p in ([root / name] if name.endswith(".py") else sorted((root / name).glob("*.py")))
    ]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                if name in CONTRACTS:
                    continue
                # sart.eval and math-verify too: votes by meaning are passed in, not imported.
                adapters = ("sart.engines", "sart.prm", "sart.bench", "sart.eval", "math_verify")
                assert not name.startswith(adapters), (
                    f"{path.relative_to(root)} imports {name}: the core must not know the adapters"
                )


def _unit(module: str) -> str | None:
    """The unit ``module`` belongs to in the import graph: a subpackage of sart
    (``sart.policies``), or a module of sart's own top level (``sart.request``)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "sart" and len(parts) > 1 else None


def _is_unit(root: Path, unit: str) -> bool:
    """Whether ``unit`` is a module or subpackage of sart (not a name imported from one)."""
    path = root.parent / unit.replace(".", "/")
    return path.is_dir() or path.with_suffix(".py").is_file()


def _module_imports(tree: ast.Module) -> list[str]:
    """What a module imports when it loads: its top-level imports, also those under an
    ``if`` (``TYPE_CHECKING`` too: a type-only edge is still a dependency) or a
    ``try``; not the deferred ones inside functions."""
    found: list[str] = []
    body: list[ast.stmt] = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse
            body += [s for h in getattr(node, "handlers", []) for s in h.body]
    return found


def test_no_import_cycle_among_sarts_packages() -> None:
    # A cycle between two packages (policies <-> rewards, say) makes import order
    # matter and gets hidden behind lazy imports; each unit may only sit above others.
    root = Path(sart.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        unit = _unit(".".join(parts))
        if unit is None:  # sart/__init__.py re-exports everything: the top, not a cycle
            continue
        for name in _module_imports(ast.parse(path.read_text(encoding="utf-8"))):
            target = _unit(name)
            if target is not None and target != unit and _is_unit(root, target):
                graph.setdefault(unit, set()).add(target)

    def reaches(start: str, goal: str) -> list[str] | None:
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop()
            for nxt in sorted(graph.get(path[-1], ())):
                if nxt == goal:
                    return [*path, nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    paths.append([*path, nxt])
        return None

    cycles = [c for unit in sorted(graph) if (c := reaches(unit, unit))]
    assert not cycles, f"import cycles: {cycles}"


def test_exported_names_exist_and_are_unique() -> None:
    for module in (sart, sart.testing):
        assert len(set(module.__all__)) == len(module.__all__)
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_quickstart_prints_one_row_per_request(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quickstart", "--requests", "3", "--n", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("q")]
    assert [r.split()[0] for r in rows] == ["q0", "q1", "q2"]
    assert all(r.split()[1] in {"42", "41", "43"} for r in rows)
    assert lines[-1].startswith("decode steps:")


def test_cli_reports_bad_settings_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["quickstart", "--n", "0"])
    assert info.value.code == 2
    assert "sart: error: --n 0 must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag", ["--requests", "--n", "--batch-size", "--interval", "--max-tokens"]
)
def test_quickstart_refuses_a_count_below_one(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: "sart quickstart --requests -1" ran "-1 requests" and exited 0.
    with pytest.raises(SystemExit) as info:
        main(["quickstart", flag, "-1"])
    assert info.value.code == 2
    assert f"{flag} -1 must be >= 1" in capsys.readouterr().err
