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
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from sart.bench.run_log import BENCH, Resumable, RunKey, RunLog, resumable_runs, run_key
from sart.errors import ConfigError, needs_extra


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` through a temporary file and a rename.

    Streamed (``json.dump``): with an indent, ``json.dumps`` encodes in Python and
    joins a list of every piece, which held 228 MB beside a 37 MB document."""
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w", encoding="utf-8") as f:
        json.dump(document, f, indent=1)
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
    what ``resume`` keeps the finished runs of an interrupted benchmark from.

    The document is ``header`` (what the benchmark was, from the runs' summaries), then
    each run's ``entry`` (with the gold answers of its rate), then whether it is
    complete. An entry is made and serialized once, when its run is added, and kept in
    an unnamed temporary file beside ``results.json``, which each rewrite copies; of
    the run itself only ``retain(record)`` stays in ``records`` (what the report reads).
    Rebuilding the whole document at each rewrite held every run's requests in memory
    twice, as records and as JSON: 2.5 GB for ``sart bench --requests 4000``."""

    def __init__(
        self,
        out: Path,
        config: Any,
        header: Callable[..., dict[str, Any]],
        entry: Callable[[Any, dict[str, str] | None], dict[str, Any]],
        *,
        retain: Callable[[Any], Any] | None = None,
        resume: bool = False,
    ) -> None:
        self.path = check_writable(out, command="sart bench")
        if not resume:
            check_not_interrupted(out)
        self.out = out
        self.config = config
        self.records: list[Any] = []
        """The runs finished, in the report's order, as ``retain`` keeps them."""
        self.kept: list[Any] = []
        """The runs kept from the interrupted benchmark this one resumes."""
        self.gold: dict[float | None, dict[str, str]] = {}
        self.serving: dict[str, Any] | None = None
        self.resume = resume
        self.log = RunLog(out)
        self._order: dict[Any, int] = {}
        self._header = header
        self._entry = entry
        self._retain = retain or (lambda record: record)
        self._entries = _Entries(out)
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
            header = self._header(self.config, [], 0.0, serving)
            runs = resumable_runs(self.out, header["config"], serving, header.get("inputs"))
            found = {run_key(r): r for r in runs}
        self.log.start(found.values())
        kept = [found[key] for key in keys if key in found]
        del found  # every run of the log, whole: what it keeps is added below
        self.kept, self.records = [], []
        for record in kept:
            self.kept.append(self._keep(record))
        return {run_key(r) for r in self.kept}

    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def add(self, record: Any) -> None:
        self.log.append(record)
        self._keep(record)
        self._unwritten += 1
        # A rewrite costs what the whole document does, which grows with every run
        # (2.9 s for 26 runs of 2,000 requests): rewritten after each run, `sart bench
        # --requests 1000` took 76 s, 56 s now (twice each, alternated). It waits until
        # ten times its cost has passed; runs.jsonl holds every run meanwhile (what
        # --resume reads), and a failure or an interruption writes it at once.
        if time.perf_counter() - self._written >= 10 * self._write_cost:
            self.write(complete=False)

    def _keep(self, record: Any) -> Any:
        """Write ``record``'s entry; keep what ``retain`` keeps of it, in order."""
        self._entries.add(run_key(record), self._entry(record, self.gold.get(record.rate)))
        kept = self._retain(record)
        self.records.append(kept)
        self.records.sort(key=lambda r: self._order.get(run_key(r), len(self._order)))
        return kept

    def flush(self) -> None:
        """Write the runs added since the last write, if any (a benchmark that failed:
        one refused before its first run leaves the file as it found it)."""
        if self._unwritten:
            self.write(complete=False)

    def write(self, *, complete: bool) -> dict[str, Any]:
        """Write ``results.json``; return it without each run's ``requests`` and
        ``timeline`` (what ``sart bench --json`` prints)."""
        began = time.perf_counter()
        header = self._header(self.config, self.records, self.elapsed(), self.serving)
        keys = [run_key(r) for r in self.records]
        ending = {
            "complete": complete,
            # Which runs were served before this invocation: their latencies were
            # measured on the machine as it was then, not side by side with the others.
            "resumed": [{"rate": r.rate, "method": r.method, "n": r.n} for r in self.kept],
        }
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        with temporary.open("wb") as f:
            # As json.dumps(document, indent=1) writes it, byte for byte.
            for i, (key, value) in enumerate([*header.items(), ("runs", None), *ending.items()]):
                f.write(f"{',' if i else '{'}\n {json.dumps(key)}: ".encode())
                if key == "runs":
                    self._entries.write_list(keys, f)
                else:
                    f.write(_indented(value, 1).encode())
            f.write(b"\n}")
        os.replace(temporary, self.path)
        self._written = time.perf_counter()
        self._write_cost = self._written - began
        self._unwritten = 0
        return header | {"runs": [self._entries.brief[key] for key in keys]} | ending

    def close(self) -> None:
        """Let go of the entries' temporary file (it has no name: nothing is left)."""
        self._entries.close()


def _indented(value: Any, level: int) -> str:
    """``value`` as ``json.dumps(..., indent=1)`` writes it ``level`` containers deep
    (JSON strings escape their newlines: every newline is the layout's)."""
    return "".join(_indented_pieces(value, level))


def _indented_pieces(value: Any, level: int) -> Iterator[str]:
    """``_indented(value, level)``, piece by piece."""
    newline = "\n" + " " * level
    for piece in json.JSONEncoder(indent=1).iterencode(value):
        yield piece.replace("\n", newline)


class _Entries:
    """Each run's ``results.json`` entry, serialized once, in an unnamed temporary file;
    ``brief`` keeps each in memory without its ``requests`` and ``timeline``."""

    def __init__(self, out: Path) -> None:
        self._file = tempfile.TemporaryFile(dir=out, prefix=".results-runs-")
        self._spans: dict[RunKey, tuple[int, int]] = {}
        self.brief: dict[RunKey, dict[str, Any]] = {}

    def add(self, key: RunKey, entry: dict[str, Any]) -> None:
        start = self._file.seek(0, os.SEEK_END)
        # Piece by piece: one run's entry is tens of MB of JSON at 5,000 requests.
        for piece in _indented_pieces(entry, 2):
            self._file.write(piece.encode())
        self._spans[key] = (start, self._file.tell() - start)
        self.brief[key] = {k: v for k, v in entry.items() if k not in ("requests", "timeline")}

    def write_list(self, keys: Sequence[RunKey], out: Any) -> None:
        """The JSON list of ``keys``' entries, one container deep, into ``out``."""
        if not keys:
            out.write(b"[]")
            return
        buffer = memoryview(bytearray(1 << 15))
        for i, key in enumerate(keys):
            out.write(b",\n  " if i else b"[\n  ")
            start, length = self._spans[key]
            self._file.seek(start)
            while length:
                got = self._file.readinto(buffer[: min(length, len(buffer))])
                if not got:
                    raise OSError(f"the temporary file of results.json lost the run {key}")
                out.write(buffer[:got])
                length -= got
        out.write(b"\n ]")

    def close(self) -> None:
        self._file.close()


__all__ = [
    "WRITERS",
    "ResultsFile",
    "check_not_interrupted",
    "check_output_file",
    "check_writable",
    "progress_console",
    "write_json",
]
