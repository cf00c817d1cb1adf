"""``OUT/runs.jsonl``: every finished run of a ``sart bench``, whole, one JSON line each.

``results.json`` is the report: it keeps what a reader needs, not everything a
``RunRecord`` holds (branch texts, reward histories, per-request KV use). This log
keeps it all, so that ``sart bench --resume`` can rebuild the runs an interrupted
benchmark finished and serve only the rest: a 200-request comparison on a CPU
takes hours, longer than a machine may be lent.

A resumed run is kept only when the benchmark that made it was the same one:
the same ``results.json`` configuration and serving (model, PRM, sampling), the
methods, ``N`` values and rates aside (those say which runs there are, not how
each ran). The log keeps all of them, those the resuming command does not name too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sart.bench.runner import RunRecord
from sart.errors import ConfigError, needs_extra
from sart.flags import FLAGS

RUN_LOG = "runs.jsonl"
SCHEMA = "sart.bench.runs/1"
#: The configuration fields that may differ between a benchmark and its resumption.
SWEPT = ("methods", "ns", "rates")

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


class RunLog:
    """The append-only log of a benchmark's finished runs."""

    def __init__(self, out: Path) -> None:
        self.path = out / RUN_LOG
        self._converter = _converter()

    def start(self, kept: Iterable[RunRecord] = ()) -> None:
        """Begin the log afresh, with the ``kept`` runs of a resumed benchmark."""
        self.path.write_text("", encoding="utf-8")
        for record in kept:
            self.append(record)

    def append(self, record: RunRecord) -> None:
        line = {
            "schema": SCHEMA,
            "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "run": self._converter.unstructure(record),
        }
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def read(self) -> list[RunRecord]:
        """The runs logged; a line cut short by an interruption is left out (its run is
        served again), a line from another schema is an error."""
        records: list[RunRecord] = []
        if not self.path.exists():
            return records
        for number, text in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            where = f"{self.path}:{number}"
            if not isinstance(line, dict) or line.get("schema") != SCHEMA:
                raise ConfigError(f"{where}: not a line of {SCHEMA}")
            records.append(self._record(line.get("run"), where))
        return records

    def _record(self, run: object, where: str) -> RunRecord:
        """A logged run, rebuilt; ``ConfigError`` naming ``file:line`` where it cannot be
        (a line edited by hand, or written by a sart whose ``RunRecord`` differed): cattrs
        reports that as a traceback of nested exception groups."""
        try:
            return self._converter.structure(run, RunRecord)
        except Exception as exc:
            reasons = _reasons(exc)
            raise ConfigError(
                f"{where}: not a run sart bench can read back ({reasons}); move {RUN_LOG} "
                "away to serve every run again, or give another --out"
            ) from None


def _reasons(exc: BaseException) -> str:
    """The innermost errors of a cattrs failure, each with the field cattrs noted it at."""
    inner = getattr(exc, "exceptions", None)
    if inner:
        reasons = [_reasons(e) for e in inner]
        return "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else "")
    where = [n for n in getattr(exc, "__notes__", None) or [] if "@" in n]
    return f"{type(exc).__name__}: {exc}" + (f" ({where[-1]})" if where else "")


def _differences(before: dict[str, Any], now: dict[str, Any], where: str) -> list[str]:
    """What differs, each named by its flag where one sets it (and by its place in
    results.json, where a reader would look)."""
    return [
        f"{FLAGS[key] + ' ' if key in FLAGS else ''}({where}.{key}): "
        f"{before.get(key)!r} then, {now.get(key)!r} now"
        for key in sorted(set(before) | set(now))
        if key not in SWEPT and before.get(key) != now.get(key)
    ]


def _results_document(results: Path) -> dict[str, Any]:
    """``results.json`` read back as the object ``sart bench`` writes (``ConfigError``
    when it is not: damaged, or another command's, which ``--resume`` cannot check the
    logged runs against)."""
    try:
        document = json.loads(results.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        document = f"not JSON: {exc.msg}" if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
    if isinstance(document, dict):
        return document
    what = document if isinstance(document, str) else f"a JSON {type(document).__name__}"
    raise ConfigError(
        f"--resume: {results} is not a sart bench results.json ({what}), which says what "
        f"benchmark the runs of {RUN_LOG} belong to; restore it, or give another --out"
    )


def resumable_runs(
    out: Path, config: dict[str, Any], serving: dict[str, Any] | None
) -> list[RunRecord]:
    """The runs of the benchmark in ``out`` that a benchmark of ``config`` (its
    ``results.json`` form) serving ``serving`` may keep: ``ConfigError`` saying what
    differs when it was another benchmark; nothing when ``out`` has none."""
    results = out / "results.json"
    if not results.exists():
        if RunLog(out).read():
            # Its runs cannot be checked against this benchmark, and starting afresh would
            # drop them from the log (as it once dropped a whole kept comparison).
            raise ConfigError(
                f"--resume: {out} holds {RUN_LOG} but no results.json, which says what "
                f"benchmark its runs belong to; restore results.json, or move {RUN_LOG} away"
            )
        return []
    document = _results_document(results)
    # Through JSON, so that tuples and lists compare as results.json holds them.
    config, serving = json.loads(json.dumps([config, serving]))
    differences = _differences(document.get("config") or {}, config, "config")
    differences += _differences(document.get("serving") or {}, serving or {}, "serving")
    if differences:
        raise ConfigError(
            f"--resume: {out} holds another benchmark (" + "; ".join(differences) + "); "
            f"give another --out, or remove {out / RUN_LOG} and leave --resume out to start "
            "afresh"
        )
    return RunLog(out).read()


__all__ = ["RUN_LOG", "RunKey", "RunLog", "resumable_runs", "run_key"]
