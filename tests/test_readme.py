"""The README's promises: its example prints what it says, its commands are the CI's."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_example_prints_what_its_comment_says() -> None:
    (block,) = re.findall(r"```python\n(.*?)```", README, re.S)
    expected = [line[2:] for line in block.splitlines() if line.startswith("# ")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {})
    assert out.getvalue().splitlines() == expected


def test_ci_runs_the_readme_test_command() -> None:
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    test_line = next(line for line in first_block.splitlines() if "pytest" in line)
    command = test_line.rsplit("&&", 1)[1].strip()
    assert command == "python -m pytest -n auto"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(rf"^{re.escape(command)}$", ci, re.M)
    assert "sart bench" in first_block


def _test_targets(text: str) -> set[str]:
    return set(re.findall(r"(tests/\S+\.py(?:::\S+?\])?)", text))


def test_the_readme_vllm_test_command_is_the_cis() -> None:
    block = next(b for b in README.split("```bash\n")[1:] if ".vllm/bin/python -m pytest" in b)
    readme = _test_targets(block.split("```", 1)[0])
    ci = _test_targets((ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert readme and readme == ci
