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
    "methods.py", "rewards", "driver.py", "async_driver.py", "score_runner.py", "servable.py",
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
