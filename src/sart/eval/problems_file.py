"""``problems.jsonl``: a recorded pass, one line per problem, appended as each finishes.

::

    {"schema": "sart.eval.problems/1", "recording": {"dataset": "math500", "n": 8, ...}}
    {"id": "0", "gold": "\\\\frac{14}{3}", "correct": [true, false, ...],
     "trace": {"id": "0", "arrival": 0.0, "answer": "\\\\frac{14}{3}", "prompt_tokens": 92,
               "interval": 400, "branches": [{"length": 3120, "answer": "\\\\frac{14}{3}",
               "rewards": [0.61, 0.58], "final_reward": 0.66}, ...]}}

The first line is the header: the settings that shaped the recording (dataset,
model, PRM, sampling, ``n``, ``T``...). Every other line is one problem: its
id, its gold answer, ``trace`` (a line of the trace format,
``docs/reference/trace-format.md``: each branch's length, answer, rewards
every ``T`` tokens and final reward) and ``correct``, each branch's answer
graded against the gold one.

The file is what makes a run resumable and auditable. Each line is written
whole and synced to disk (``flush`` + ``fsync``) before the next problem is
recorded, so an interrupted run (Ctrl-C, a crash, a lost machine) loses at
most the problems in flight. Opening the file again:

- refuses it when its header's settings differ from this run's (the lines
  would mix two experiments), naming each difference;
- drops a last line without its newline (a write cut short) and keeps the
  others; a damaged line elsewhere is refused with ``file:line``, as a file
  edited by hand should be, not silently skipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import attrs

from sart import converters
from sart.bench.traces import TraceRequest
from sart.errors import ConfigError

SCHEMA = "sart.eval.problems/1"


@attrs.frozen
class ProblemRecord:
    """One recorded problem: every branch run to its end, and each branch's grade."""

    id: str
    gold: str
    trace: TraceRequest
    """The branches as a trace line (length, answer, rewards, final reward)."""
    correct: tuple[bool, ...] = attrs.field(converter=converters.bools)
    """Whether each branch's answer is the gold one (same order as ``trace.branches``)."""

    def __attrs_post_init__(self) -> None:
        if len(self.correct) != len(self.trace.branches):
            raise ConfigError(
                f"problem {self.id!r}: {len(self.correct)} grades for "
                f"{len(self.trace.branches)} branches"
            )

    @property
    def width(self) -> int:
        """Branches recorded."""
        return len(self.trace.branches)

    def correct_answer(self, answer: str | None) -> bool | None:
        """The grade of a branch that gave ``answer`` (``None``: no recorded branch did)."""
        for branch, correct in zip(self.trace.branches, self.correct):
            if branch.answer == answer:
                return correct
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "gold": self.gold,
            "correct": list(self.correct),
            "trace": self.trace.to_json(),
        }

    @classmethod
    def from_json(cls, line: object, where: str) -> ProblemRecord:
        if not isinstance(line, dict) or not {"id", "gold", "correct", "trace"} <= line.keys():
            raise ConfigError(f"{where}: needs a JSON object with id, gold, correct and trace")
        correct = line["correct"]
        if not isinstance(correct, list) or not all(isinstance(c, bool) for c in correct):
            raise ConfigError(f"{where}: 'correct' must be a list of true/false")
        trace = TraceRequest.from_json(line["trace"], where)
        if trace.id != line["id"]:
            raise ConfigError(f"{where}: the trace's id {trace.id!r} is not {line['id']!r}")
        return cls(str(line["id"]), str(line["gold"]), trace, correct)


class ProblemsFile:
    """The recorded problems of one ``--out`` directory, open for appending.

    ``ProblemsFile(path, recording)`` creates the file with ``recording`` as its
    header, or opens an existing one after checking its header against
    ``recording`` (``names`` maps a setting to the flag users know it by, for
    the refusal's message). ``records`` holds the problems already recorded, by
    id, in file order; ``append`` adds one, durably.
    """

    def __init__(
        self,
        path: Path,
        recording: Mapping[str, Any],
        names: Mapping[str, str] | None = None,
        upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.path = path
        self._upgrade = upgrade
        """A header's settings as this sart spells them, where an older one wrote them
        otherwise (compared after it, so that the recording resumes)."""
        self.recording = dict(recording)
        self.records: dict[str, ProblemRecord] = {}
        self.dropped_partial_line = False
        """Whether opening it dropped a last line cut short (an interrupted write)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.stat().st_size > 0:
            self._resume(names or {})
            self._file: IO[str] = path.open("a", encoding="utf-8")
        else:
            self._file = path.open("w", encoding="utf-8")
            self._write({"schema": SCHEMA, "recording": self.recording})

    def __enter__(self) -> ProblemsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def append(self, record: ProblemRecord) -> None:
        """Write ``record``'s line and sync it to disk before returning."""
        if record.id in self.records:
            raise ConfigError(f"problem {record.id!r} is already in {self.path}")
        self._write(record.to_json())
        self.records[record.id] = record

    def _write(self, line: dict[str, Any]) -> None:
        # One write of the whole line: a crash leaves the line whole or cut short,
        # and a line cut short is the last one, which _resume drops.
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def _resume(self, names: Mapping[str, str]) -> None:
        raw = self.path.read_bytes()
        complete = raw[: raw.rfind(b"\n") + 1]
        if len(complete) != len(raw):
            # The last write was cut short: drop its bytes, keep every whole line.
            with self.path.open("r+b") as f:
                f.truncate(len(complete))
            self.dropped_partial_line = True
        lines = _numbered(complete, self.path)
        first = next(lines, None)
        if first is None:  # only a partial header: start afresh
            with self.path.open("w", encoding="utf-8") as f:
                f.write(json.dumps({"schema": SCHEMA, "recording": self.recording}) + "\n")
            return
        number, header = first
        where = f"{self.path}:{number}"
        if not isinstance(header, dict) or header.get("schema") != SCHEMA:
            raise ConfigError(
                f"{where}: not a sart eval recording (no {SCHEMA!r} header); give another --out"
            )
        self._check_settings(header.get("recording"), names)
        for number, line in lines:
            where = f"{self.path}:{number}"
            record = ProblemRecord.from_json(line, where)
            if record.id in self.records:
                raise ConfigError(f"{where}: problem {record.id!r} is recorded twice")
            self.records[record.id] = record

    def _check_settings(self, recorded: object, names: Mapping[str, str]) -> None:
        recorded = recorded if isinstance(recorded, dict) else {}
        if self._upgrade is not None:
            recorded = self._upgrade(recorded)
        wanted = json.loads(json.dumps(self.recording))  # as it reads back from JSON
        keys = list(dict.fromkeys([*wanted, *recorded]))
        differences = [
            f"{names.get(k, k)} {_show(recorded.get(k))} (this run: {_show(wanted.get(k))})"
            for k in keys
            if recorded.get(k) != wanted.get(k)
        ]
        if differences:
            raise ConfigError(
                f"{self.path} was recorded with other settings: "
                + "; ".join(differences)
                + ". Run with the same settings to resume it, or give another --out"
            )


def _show(value: object) -> str:
    return "(unset)" if value is None else json.dumps(value)


def _numbered(raw: bytes, path: Path) -> Iterator[tuple[int, object]]:
    """``(line number, decoded JSON)`` for each non-blank line."""
    for number, text in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not text.strip():
            continue
        try:
            yield number, json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{path}:{number}: not JSON ({exc.msg}); a damaged line that is not the last one "
                "is not from an interruption: remove it by hand or give another --out"
            ) from None


__all__ = ["SCHEMA", "ProblemRecord", "ProblemsFile"]
