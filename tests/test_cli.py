"""The ``sart`` command line: missing extras and unwritable files end in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from sart.cli import main


def test_a_missing_extra_names_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    # Before: `sart demo-models` without torch ended in a raw ModuleNotFoundError.
    import sart.demo_models

    def needs_torch(*args: object, **kwargs: object) -> None:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(sart.demo_models, "build_demo_models", needs_torch)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo-models", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "sart demo-models needs torch: pip install 'sart[hf]'" in capsys.readouterr().err


def test_an_unrelated_missing_module_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    import sart.demo_models

    def broken(*args: object, **kwargs: object) -> None:
        raise ModuleNotFoundError("No module named 'sart.typo'", name="sart.typo")

    monkeypatch.setattr(sart.demo_models, "build_demo_models", broken)
    with pytest.raises(ModuleNotFoundError):
        main(["demo-models", "x"])


@pytest.mark.parametrize("where", ["a directory", "a missing parent"])
def test_trace_record_into_an_unwritable_path_is_one_line(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Before: a raw IsADirectoryError / FileNotFoundError traceback.
    target = tmp_path if where == "a directory" else tmp_path / "no" / "such" / "t.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        main(["trace", "record", str(target), "--requests", "5"])
    assert exit_info.value.code == 2
    assert f"sart: error: {target}" in capsys.readouterr().err


def test_ctrl_c_in_any_command_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    # Before: a KeyboardInterrupt traceback (sart bench says what it kept, itself).
    import sart.demo_models

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(sart.demo_models, "build_demo_models", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo-models", str(tmp_path)])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == "sart: demo-models interrupted\n"
