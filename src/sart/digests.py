"""A file's sha256, read in blocks: what ``results.json`` records of a benchmark's input
files (``sart.bench.inputs``) and a testbed's manifest of its weights
(``sart.testbed.train``). Its own module, below both: the testbed may not import the
benchmarks (``tests/test_package.py`` keeps the packages free of import cycles)."""

from __future__ import annotations

import hashlib
from pathlib import Path

#: A file is read in blocks of this size: a trace or a weights file can be large.
BLOCK = 1 << 20


def sha256(path: Path) -> str:
    """The file's sha256, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


__all__ = ["BLOCK", "sha256"]
