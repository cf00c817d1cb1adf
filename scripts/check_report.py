"""``Report``: the one-line-per-check reporter of ``gpu_check.py`` (both engines).

A check is a callable returning its detail line, or the line and its numbers (a
dict) for ``--json``. A check that raises is a FAIL line naming the exception and
where it was raised; the other checks still run. Not part of sart.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Report:
    """Prints one line per check; keeps every check's row, written to ``json_path`` (if
    given) as each check ends."""

    def __init__(self, width: int = 18, json_path: Path | None = None) -> None:
        self.rows: list[dict[str, Any]] = []
        self._width = width
        self._json_path = json_path
        """Where the rows are written after every check (a run stopped by a time
        limit keeps the checks it finished)."""

    @property
    def failed(self) -> list[str]:
        return [row["check"] for row in self.rows if not row["ok"]]

    def check(self, name: str, run: Callable[[], str | tuple[str, dict[str, Any]]]) -> str | None:
        """Run one check and print its line: its detail, or ``None`` if it failed."""
        started = time.perf_counter()
        data: dict[str, Any] = {}
        try:
            result = run()
        except Exception as exc:  # a check's failure is reported, the others still run
            where = traceback.extract_tb(exc.__traceback__)[-1]
            detail = f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})"
            ok = False
        else:
            detail, data = result if isinstance(result, tuple) else (result, {})
            ok = True
        seconds = time.perf_counter() - started
        print(
            f"{'PASS' if ok else 'FAIL'}  {name:<{self._width}} {detail} [{seconds:.1f} s]",
            flush=True,
        )
        self.rows.append(
            {"check": name, "ok": ok, "detail": detail, "seconds": seconds, "data": data}
        )
        if self._json_path is not None:
            self._json_path.write_text(json.dumps(self.rows, indent=1))
        return detail if ok else None

    def finish(self) -> int:
        """The closing line (the rows are written as each check ends): exit status 1
        if any failed."""
        failed = self.failed
        print(
            f"gpu_check: FAILED {', '.join(failed)}" if failed else "gpu_check: all checks passed",
            flush=True,
        )
        return 1 if failed else 0
