"""The files a benchmark read its requests from (``sart.bench.inputs``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from sart.bench.inputs import input_differences, input_digests, input_files


def test_only_files_are_inputs_a_workload_preset_is_not(tmp_path: Path) -> None:
    assert input_files(None, "gaokao") == {}
    assert input_files("a.jsonl", None, "p.jsonl") == {"--trace": "a.jsonl", "--prompts": "p.jsonl"}
    assert input_files(None, "recorded.jsonl.gz") == {"--workload": "recorded.jsonl.gz"}


def test_a_digest_is_the_files_sha256_and_follows_its_content(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    before = input_digests(None, None, str(prompts))
    digest = hashlib.sha256(prompts.read_bytes()).hexdigest()
    assert before == {"--prompts": {"path": str(prompts), "sha256": digest}}
    assert input_differences(before, input_digests(None, None, str(prompts))) == []
    prompts.write_text('{"prompt": "1+2?", "answer": "3"}\n')
    (changed,) = input_differences(before, input_digests(None, None, str(prompts)))
    assert changed.startswith(f"--prompts {prompts}: the file changed since (sha256 ")
    other = tmp_path / "q.jsonl"
    other.write_text("")
    assert input_differences(before, input_digests(None, None, str(other))) == [
        f"--prompts: {str(prompts)!r} then, {str(other)!r} now"
    ]
    assert input_differences(before, {}) == [f"--prompts: {str(prompts)!r} then, None now"]


def test_a_file_that_cannot_be_read_is_left_for_the_command_to_refuse(tmp_path: Path) -> None:
    assert input_digests(str(tmp_path / "missing.jsonl"), None) == {}
