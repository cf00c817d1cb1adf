"""The files a benchmark read its requests from, each with its content's sha256.

``--trace FILE``, ``--workload FILE`` (a trace resampled) and ``--prompts FILE``
name a file by its path, and the path is all ``results.json``'s ``config`` held:
a trace recorded again under the same name, or a prompt file edited, was resumed
(``--resume``) as if it were the same benchmark, mixing runs served on different
requests in one report. ``results.json`` and ``tune.json`` record this ``inputs``
object, and ``--resume`` compares it (``sart.bench.run_log.resumable``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sart.bench.traces import is_trace_file
from sart.bench.workloads import WORKLOADS
from sart.digests import sha256


def input_files(
    trace: str | None, workload: str | None, prompts: str | None = None
) -> dict[str, str]:
    """The files the requests come from, by the flag that names each (a workload
    preset's name is not a file)."""
    files = {"--trace": trace, "--prompts": prompts}
    if workload is not None and workload not in WORKLOADS and is_trace_file(workload):
        files["--workload"] = workload
    return {flag: path for flag, path in files.items() if path is not None}


def input_digests(
    trace: str | None, workload: str | None, prompts: str | None = None
) -> dict[str, dict[str, str]]:
    """``input_files`` with each file's path and sha256, as ``results.json`` records
    them (read when the benchmark starts; a file that cannot be read is left for the
    command to refuse in its own words)."""
    digests = {}
    for flag, path in input_files(trace, workload, prompts).items():
        try:
            digests[flag] = {"path": path, "sha256": sha256(Path(path))}
        except OSError:
            continue
    return digests


def input_differences(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two ``inputs`` objects, each said by its flag."""
    differences = []
    for flag in sorted(set(before) | set(now)):
        then, current = before.get(flag) or {}, now.get(flag) or {}
        if then.get("path") != current.get("path"):
            differences.append(f"{flag}: {then.get('path')!r} then, {current.get('path')!r} now")
        elif then.get("sha256") != current.get("sha256"):
            differences.append(
                f"{flag} {current.get('path')}: the file changed since (sha256 "
                f"{str(then.get('sha256'))[:12]} then, {str(current.get('sha256'))[:12]} now)"
            )
    return differences


__all__ = ["input_differences", "input_digests", "input_files"]
