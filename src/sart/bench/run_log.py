"""``OUT/runs.jsonl``: every finished run of a ``sart bench``, whole, one JSON line each
(and ``OUT/tune-runs.jsonl``, the same for a ``sart tune``).

``results.json`` is the report: it keeps what a reader needs, not everything a
``RunRecord`` holds (branch texts, reward histories, per-request KV use). This log
keeps it all, so that ``sart bench --resume`` can rebuild the runs an interrupted
benchmark finished and serve only the rest: a 200-request comparison on a CPU
takes hours, longer than a machine may be lent.

A resumed run is kept only when the benchmark that made it was the same one:
the same ``results.json`` configuration, serving (model, PRM, sampling) and input
files (their contents, ``sart.bench.inputs``), the methods, ``N`` values and rates
aside (those say which runs there are, not how each ran). The log keeps all of
them, those the resuming command does not name too.

``sart tune --resume`` keeps a tune's runs the same way (``Resumable`` names each
command's files and words); every option of a tune says how its runs ran, so none
may differ.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Generic, TypeVar

import attrs

from sart.bench.inputs import input_differences
from sart.bench.runner import RunRecord
from sart.errors import ConfigError, needs_extra
from sart.flags import FLAGS

RUN_LOG = "runs.jsonl"
SCHEMA = "sart.bench.runs/1"
#: The configuration fields that may differ between a benchmark and its resumption.
SWEPT = ("methods", "ns", "rates")


@attrs.frozen
class Resumable:
    """A command that keeps its finished runs in a log and resumes from it: its files,
    and the words its messages use."""

    command: str
    """As the user types it: ``sart bench``."""
    report: str
    """The report in ``--out`` that holds the configuration the runs belong to."""
    log: str
    """The log of finished runs in ``--out``."""
    schema: str
    """Of the log's lines."""
    what: str
    """What one invocation is called: ``benchmark``."""
    redo: str
    """What it does to a run again: ``serve``."""
    swept: tuple[str, ...] = ()
    """The configuration fields that may differ between a run and its resumption."""


BENCH = Resumable("sart bench", "results.json", RUN_LOG, SCHEMA, "benchmark", "serve", SWEPT)
TUNE = Resumable("sart tune", "tune.json", "tune-runs.jsonl", "sart.tune.runs/1", "tune", "run")

RunKey = tuple[float | None, str, int]


def run_key(record: RunRecord) -> RunKey:
    """Which run of a benchmark ``record`` is: its rate, method and ``n``."""
    return (record.rate, record.method, record.n)


def _converter() -> Any:
    with needs_extra("sart bench's log of its runs", "bench"):
        import cattrs
    converter = cattrs.Converter()
    # A branch's stop_reason (a stop string or token id), a union cattrs has no hook for.
    converter.register_structure_hook_func(lambda t: t == (str | int | None), _stop_reason)
    return converter


def _stop_reason(value: Any, _type: Any) -> str | int | None:
    if value is None or isinstance(value, str) or type(value) is int:
        return value  # type: ignore[no-any-return]
    raise TypeError(f"stop_reason={value!r} must be a string, an int or null")


Record = TypeVar("Record")


class RecordLog(Generic[Record]):
    """The append-only log of a command's finished runs, each a ``kind`` (an attrs class)."""

    def __init__(self, out: Path, kind: type[Record], of: Resumable) -> None:
        self.path = out / of.log
        self.kind = kind
        self.of = of
        self._converter = _converter()

    def start(self, kept: Iterable[Record] = ()) -> None:
        """Begin the log afresh, with the ``kept`` runs of a resumed one."""
        self.path.write_text("", encoding="utf-8")
        for record in kept:
            self.append(record)

    def append(self, record: Record) -> None:
        line = {
            "schema": self.of.schema,
            "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "run": self._converter.unstructure(record),
        }
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def read(self) -> list[Record]:
        """The runs logged; a line cut short by an interruption is left out (its run is
        done again), a line from another schema is an error."""
        records: list[Record] = []
        if not self.path.exists():
            return records
        for number, text in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            where = f"{self.path}:{number}"
            if not isinstance(line, dict) or line.get("schema") != self.of.schema:
                raise ConfigError(f"{where}: not a line of {self.of.schema}")
            records.append(self._record(line.get("run"), where))
        return records

    def _record(self, run: object, where: str) -> Record:
        """A logged run, rebuilt; ``ConfigError`` naming ``file:line`` where it cannot be
        (a line edited by hand, or written by a sart whose record class differed): cattrs
        reports that as a traceback of nested exception groups."""
        try:
            return self._converter.structure(run, self.kind)  # type: ignore[no-any-return]
        except Exception as exc:
            reasons = _reasons(exc)
            raise ConfigError(
                f"{where}: not a run {self.of.command} can read back ({reasons}); move "
                f"{self.of.log} away to {self.of.redo} every run again, or give another --out"
            ) from None


class RunLog(RecordLog[RunRecord]):
    """The append-only log of a benchmark's finished runs."""

    def __init__(self, out: Path) -> None:
        super().__init__(out, RunRecord, BENCH)


def _reasons(exc: BaseException) -> str:
    """The innermost errors of a cattrs failure, each with the field cattrs noted it at."""
    inner = getattr(exc, "exceptions", None)
    if inner:
        reasons = [_reasons(e) for e in inner]
        return "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else "")
    where = [n for n in getattr(exc, "__notes__", None) or [] if "@" in n]
    return f"{type(exc).__name__}: {exc}" + (f" ({where[-1]})" if where else "")


def _differences(
    before: dict[str, Any], now: dict[str, Any], where: str, swept: Iterable[str] = ()
) -> list[str]:
    """What differs, each named by its flag where one sets it (and by its place in
    the report, where a reader would look)."""
    return [
        f"{FLAGS[key] + ' ' if key in FLAGS else ''}({where}.{key}): "
        f"{before.get(key)!r} then, {now.get(key)!r} now"
        for key in sorted(set(before) | set(now))
        if key not in swept and before.get(key) != now.get(key)
    ]


def _report_document(report: Path, of: Resumable) -> dict[str, Any]:
    """The report read back as the object ``of.command`` writes (``ConfigError`` when it
    is not: damaged, or another command's, which ``--resume`` cannot check the logged
    runs against)."""
    try:
        document = json.loads(report.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        document = f"not JSON: {exc.msg}" if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
    if isinstance(document, dict):
        return document
    what = document if isinstance(document, str) else f"a JSON {type(document).__name__}"
    raise ConfigError(
        f"--resume: {report} is not a {of.command} {of.report} ({what}), which says what "
        f"{of.what} the runs of {of.log} belong to; restore it, or give another --out"
    )


def resumable(
    log: RecordLog[Record],
    config: dict[str, Any],
    serving: dict[str, Any] | None = None,
    inputs: dict[str, Any] | None = None,
) -> list[Record]:
    """The runs of ``log`` that a run of ``config`` (its report's form) serving
    ``serving`` on ``inputs`` (``sart.bench.inputs``) may keep: ``ConfigError`` saying
    what differs when they were another one's; nothing when ``out`` has none.

    A report written before sart recorded its inputs has none to compare: its runs
    are kept, as they were before."""
    of, out = log.of, log.path.parent
    report = out / of.report
    if not report.exists():
        if log.read():
            # Its runs cannot be checked against this one, and starting afresh would
            # drop them from the log (as it once dropped a whole kept comparison).
            raise ConfigError(
                f"--resume: {out} holds {of.log} but no {of.report}, which says what "
                f"{of.what} its runs belong to; restore {of.report}, or move {of.log} away"
            )
        return []
    document = _report_document(report, of)
    # Through JSON, so that tuples and lists compare as the report holds them.
    config, serving = json.loads(json.dumps([config, serving]))
    differences = _differences(document.get("config") or {}, config, "config", of.swept)
    differences += _differences(document.get("serving") or {}, serving or {}, "serving")
    if "inputs" in document:
        differences += input_differences(document["inputs"] or {}, inputs or {})
    if differences:
        raise ConfigError(
            f"--resume: {out} holds another {of.what} (" + "; ".join(differences) + "); "
            f"give another --out, or remove {out / of.log} and leave --resume out to start "
            "afresh"
        )
    return log.read()


def resumable_runs(
    out: Path,
    config: dict[str, Any],
    serving: dict[str, Any] | None,
    inputs: dict[str, Any] | None = None,
) -> list[RunRecord]:
    """The runs of the benchmark in ``out`` that a benchmark of ``config`` (its
    ``results.json`` form) serving ``serving`` on ``inputs`` may keep: ``ConfigError``
    saying what differs when it was another benchmark; nothing when ``out`` has none."""
    return resumable(RunLog(out), config, serving, inputs)


__all__ = [
    "BENCH",
    "RUN_LOG",
    "TUNE",
    "RecordLog",
    "Resumable",
    "RunKey",
    "RunLog",
    "resumable",
    "resumable_runs",
    "run_key",
]
