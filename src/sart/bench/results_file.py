"""Writing a command's ``results.json`` atomically, and the progress display commands share.

``ResultsFile`` is ``sart bench``'s: rewritten as runs finish, so that an
interrupted or failing benchmark keeps what finished. ``write_json`` is the atomic
write both it and ``sart eval`` use (a reader never sees half a file);
``progress_console`` is the rich console and progress bar of both.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sart.bench.run_log import BENCH, Resumable, RunKey, RunLog, resumable_runs, run_key
from sart.errors import ConfigError, needs_extra


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` through a temporary file and a rename."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(document, indent=1), encoding="utf-8")
    os.replace(temporary, path)


#: The commands that write a ``results.json``, by its schema's name before the version.
WRITERS = {"sart.bench": "sart bench", "sart.eval": "sart eval"}


def check_writable(out: Path, name: str = "results.json", command: str | None = None) -> Path:
    """``out / name``, once ``out`` is known to take it (``ConfigError`` naming ``--out``
    otherwise, before any work is done): writable, and not another ``command``'s
    ``results.json`` (``sart bench`` and ``sart eval`` both write one)."""
    path = out / name
    if command is not None:
        _check_writer(path, out, command)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        probe = out / f".{name}.tmp"
        probe.write_text("", encoding="utf-8")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"--out {str(out)!r}: cannot write {name} there ({exc.strerror or exc})"
        ) from None
    return path


def check_output_file(path: Path, flag: str) -> None:
    """``ConfigError`` naming ``flag`` unless a file can be written at ``path``: checked
    before the work whose output it is (``--record-trace`` was checked only once the
    benchmark and the recording pass had run, which lost the recording)."""
    existed = path.exists()
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        with path.open("a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{flag} {str(path)!r}: cannot write it ({exc.strerror or exc})"
        ) from None
    if not existed:
        path.unlink()


def _check_writer(path: Path, out: Path, command: str) -> None:
    """Refuse to overwrite another command's results (``sart eval`` into a benchmark's
    ``--out`` replaced its results.json, without which ``--resume`` keeps none of its
    runs). A file that does not read as JSON is not checked: it holds nothing to keep."""
    document = _kept_document(path)
    schema = document.get("schema") if document is not None else None
    writer = WRITERS.get(str(schema).split("/")[0])
    if writer is not None and writer != command:
        raise ConfigError(
            f"--out {str(out)!r} holds the {path.name} of {writer} ({schema}), which this "
            f"{command} would overwrite; give another --out"
        )


def check_not_interrupted(out: Path, of: Resumable = BENCH) -> None:
    """``ConfigError`` where ``out`` holds a benchmark (or another ``of.what``) that was
    interrupted with runs finished: starting afresh emptied its log, and the same command
    run again without ``--resume`` (a script rerun, the flag forgotten) lost hours of runs."""
    document = _kept_document(out / of.report)
    try:
        logged = (out / of.log).read_bytes().count(b"\n")
    except OSError:
        return  # nothing this command could resume
    if document is not None and document.get("complete") is False and logged:
        raise ConfigError(
            f"--out {str(out)!r} holds an interrupted {of.what} ({logged} finished runs in "
            f"{of.log}): add --resume to keep them and {of.redo} only the rest, or remove "
            f"{out / of.log} to start afresh"
        )


def _kept_document(path: Path) -> dict[str, Any] | None:
    """The JSON object a command left at ``path`` (``None``: none, or not one that reads
    as JSON: it holds nothing to keep)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return document if isinstance(document, dict) else None


def progress_console(command: str, *, to_stderr: bool) -> tuple[Any, Any]:
    """A rich console (on stderr when stdout carries JSON) and a transient progress bar
    on it. A pipe or CI log gets a table wide enough not to wrap (rich assumes 80; the
    widest, with failures, SLO and preemption marks, takes about 130)."""
    with needs_extra(command, "bench"):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    console = Console(stderr=to_stderr, width=None if Console().is_terminal else 132)
    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    return console, progress


class ResultsFile:
    """``results.json``, rewritten atomically as runs finish (at most a tenth of the
    benchmark's time: ``add``), and at once when it ends, is interrupted or fails;
    ``complete`` says whether every run did. Every run is also logged whole (``RunLog``), which is
    what ``resume`` keeps the finished runs of an interrupted benchmark from."""

    def __init__(
        self, out: Path, config: Any, document: Callable[..., dict], *, resume: bool = False
    ) -> None:
        self.path = check_writable(out, command="sart bench")
        if not resume:
            check_not_interrupted(out)
        self.out = out
        self.config = config
        self.records: list[Any] = []
        self.kept: list[Any] = []
        """The runs kept from the interrupted benchmark this one resumes."""
        self.gold: dict[float | None, dict[str, str]] = {}
        self.serving: dict[str, Any] | None = None
        self.resume = resume
        self.log = RunLog(out)
        self._order: dict[Any, int] = {}
        self._document = document
        self._started = time.perf_counter()
        self._written = -float("inf")  # when results.json was last written
        self._write_cost = 0.0  # and how long that took
        self._unwritten = 0  # runs added since

    def begin(self, serving: dict[str, Any] | None, keys: Sequence[RunKey]) -> set[RunKey]:
        """Say what is served, before the first run; ``keys`` are the runs of this
        benchmark, in the order the report lists them. Returns those already done:
        with ``resume``, the runs of ``keys`` that the benchmark in ``out`` finished,
        when it was this one (``ConfigError`` saying what differs otherwise).

        A resumed log keeps every run it held, those of other methods, ``N`` values and
        rates too: the report shows this command's runs, and a later resumption naming
        the others finds them still there (a run can take an hour to measure again)."""
        self.serving = serving
        self._order = {key: i for i, key in enumerate(keys)}
        found: dict[RunKey, Any] = {}
        if self.resume:
            config = self._document(self.config, [], self.gold, 0.0, serving)["config"]
            found = {run_key(r): r for r in resumable_runs(self.out, config, serving)}
            self.kept = [found[key] for key in keys if key in found]
        self.records = list(self.kept)
        self.log.start(found.values())
        return {run_key(r) for r in self.kept}

    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def add(self, record: Any) -> None:
        self.log.append(record)
        self.records.append(record)
        self.records.sort(key=lambda r: self._order.get(run_key(r), len(self._order)))
        self._unwritten += 1
        # A rewrite costs what the whole document does, which grows with every run
        # (2.9 s for 26 runs of 2,000 requests): rewritten after each run, `sart bench
        # --requests 1000` took 76 s, 56 s now (twice each, alternated). It waits until
        # ten times its cost has passed; runs.jsonl holds every run meanwhile (what
        # --resume reads), and a failure or an interruption writes it at once.
        if time.perf_counter() - self._written >= 10 * self._write_cost:
            self.write(complete=False)

    def flush(self) -> None:
        """Write the runs added since the last write, if any (a benchmark that failed:
        one refused before its first run leaves the file as it found it)."""
        if self._unwritten:
            self.write(complete=False)

    def write(self, *, complete: bool) -> dict[str, Any]:
        began = time.perf_counter()
        document = self._document(
            self.config, self.records, self.gold, self.elapsed(), self.serving
        )
        document["complete"] = complete
        # Which runs were served before this invocation: their latencies were measured
        # on the machine as it was then, not side by side with the others.
        document["resumed"] = [{"rate": r.rate, "method": r.method, "n": r.n} for r in self.kept]
        write_json(self.path, document)
        self._written = time.perf_counter()
        self._write_cost = self._written - began
        self._unwritten = 0
        return document


__all__ = [
    "WRITERS",
    "ResultsFile",
    "check_not_interrupted",
    "check_output_file",
    "check_writable",
    "progress_console",
    "write_json",
]
