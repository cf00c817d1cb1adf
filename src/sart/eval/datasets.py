"""Benchmark datasets: problems with gold answers, from a local file or the Hugging Face hub.

A ``Dataset`` is data: its ``Problem``s, the ``PromptTemplate`` that words
them and the name of the grader that checks answers (``sart.eval.grading``).
The stock datasets (``DATASETS``, loaded by ``load_dataset(name, path)``; with no
path, from the hub through ``datasets``):

- ``math500``: MATH-500, JSONL; hub ``HuggingFaceH4/MATH-500`` (split test);
  graded by math-verify;
- ``aime2024``: JSONL; hub ``HuggingFaceH4/aime_2024`` (split train); math-verify;
- ``aime2025``: JSONL; hub ``math-ai/aime25`` (split test); math-verify;
- ``gpqa-diamond``: CSV or JSONL; hub ``Idavidrein/gpqa``, config
  ``gpqa_diamond`` (split train; gated: accept its terms on the hub and log
  in first); graded by option letter;
- ``jsonl``: a user's JSONL file (no hub); math-verify (``load_jsonl``
  picks another template or grader).

Besides these, ``load_testbed(count, seed)`` makes the testbed's questions
(``sart.testbed``) a dataset, graded exactly: what ``sart eval --dataset
testbed`` evaluates with no file and no GPU.

Rows: math datasets and user files have ``problem`` and ``answer`` (a
string, or an integer); every other field is kept in ``Problem.fields``
(MATH-500's ``level``, ``subject``, ``solution``). A problem's id is the
row's ``id``, else its ``unique_id``, else its 0-based position. AIME
answers must be integers 0-999. GPQA rows have GPQA's columns
(``Question``, ``Correct Answer``, ``Incorrect Answer 1`` to ``3``, and
optionally ``Record ID``, ``High-level domain``, ``Subdomain``); the four
options are shuffled with a seed per problem (``seed`` and the id), so an
option's letter does not depend on the order of the rows, and the gold
answer is the correct option's letter.

A malformed row raises ``ConfigError`` naming the file, the line (a CSV
record's first line) and the field. Hub access is imported lazily: without
``datasets`` (``pip install -e '.[eval]'``) a hub load raises
``MissingDependencyError``; local files need nothing but the standard library.
"""

from __future__ import annotations

import csv
import json
import random
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from sart.errors import ConfigError, config_check, needs_extra
from sart.eval.prompts import LETTERS, MATH, MULTIPLE_CHOICE, PromptTemplate, render_prompt

GRADINGS = ("math-verify", "choice", "exact")
"""Grader names a dataset may name (``sart.eval.grading.make_grader``)."""


@attrs.frozen
class Problem:
    """One benchmark problem: its id, its text, its gold answer, and any other fields."""

    id: str
    problem: str
    """The problem statement, without instructions (the template adds them)."""
    answer: str
    """The gold answer: LaTeX for MATH, an integer string for AIME, a letter for GPQA."""
    fields: dict[str, Any] = attrs.field(factory=dict, hash=False)
    """Everything else the row had: ``level``, ``subject``, ``choices``, ``solution``..."""


def _problems(items: Iterable[Problem]) -> tuple[Problem, ...]:
    return tuple(items)


def _check_grading(_inst: object, _attr: attrs.Attribute, value: str) -> None:
    config_check(value in GRADINGS, "grading", value, f"one of {', '.join(GRADINGS)}")


@attrs.frozen
class Dataset:
    """Problems, the template that words them, and the grader that checks their answers."""

    name: str
    problems: tuple[Problem, ...] = attrs.field(converter=_problems)
    template: PromptTemplate = MATH
    grading: str = attrs.field(default="math-verify", validator=_check_grading)
    """The grader's name: ``math-verify``, ``choice`` or ``exact``."""
    source: str = ""
    """Where the problems came from: a path, or ``hf:<dataset id>``."""

    def __len__(self) -> int:
        return len(self.problems)

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.problems)

    def head(self, count: int) -> Dataset:
        """The first ``count`` problems (a subset for quick runs)."""
        config_check(isinstance(count, int) and count >= 1, "limit", count, ">= 1")
        return attrs.evolve(self, problems=self.problems[:count])

    def prompt(self, problem: Problem, tokenizer: Any = None) -> str:
        """``problem`` worded by this dataset's template (see ``render_prompt``)."""
        return render_prompt(problem, self.template, tokenizer)


# ------------------------------------------------------------------------ reading rows


def read_rows(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for each record of a JSONL (``.jsonl``, ``.json``) or CSV
    (``.csv``) file; ``where`` is ``path:line``. Blank JSONL lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"path={str(path)!r}: no such file")
    if path.suffix.lower() == ".csv":
        yield from _csv_rows(path)
    else:
        yield from _jsonl_rows(path)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    # Read as bytes and decoded line by line, so that a byte that is not UTF-8 is
    # refused with its line (a text-mode read raised UnicodeDecodeError, a traceback).
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            where = f"{path}:{number}"
            line = _utf8(raw, where)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: a row must be a JSON object, not {row!r:.60}")
            yield where, row


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text (byte {exc.start + 1})") from None


def _csv_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        start = 2  # line 1 is the header
        try:
            for row in reader:
                yield f"{path}:{start}", row
                start = reader.line_num + 1
        except UnicodeDecodeError:
            # Decoded in blocks, so the line is only known to be at or after ``start``.
            raise ConfigError(f"{path}:{start}: not UTF-8 text (at this line or after)") from None


def hub_rows(
    dataset_id: str, split: str, config: str | None = None, *, name: str = ""
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for each row of a Hugging Face hub dataset, through ``datasets``."""
    what = f"dataset {name!r}" if name else f"hub dataset {dataset_id!r}"
    with needs_extra(f"loading {what} from the Hugging Face hub (or give a local file)", "eval"):
        import datasets
    try:
        rows = datasets.load_dataset(dataset_id, config, split=split)
    except OSError as exc:  # the hub out of reach (ConnectionError), or no such dataset
        raise ConfigError(
            f"{what}: could not be read from the Hugging Face hub ({exc}); give a local "
            "copy instead (sart eval --data FILE)"
        ) from None
    for index, row in enumerate(rows):
        yield f"{dataset_id} ({split}) row {index}", dict(row)


# ------------------------------------------------------------------- rows to problems

Convert = Callable[[Mapping[str, Any], str, int, int], Problem]
"""``(row, where, position, seed) -> Problem``."""


def _text(row: Mapping[str, Any], field: str, where: str) -> str:
    if field not in row or row[field] is None:
        raise ConfigError(f"{where}: field {field!r} is missing")
    value = row[field]
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: field {field!r}={value!r:.60} must be a non-empty string")
    return value


def _answer(row: Mapping[str, Any], field: str, where: str) -> str:
    value = row.get(field)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return _text(row, field, where).strip()


def _id(
    row: Mapping[str, Any], fields: tuple[str, ...], where: str, position: int
) -> tuple[str, str | None]:
    """The problem's id and the field it came from (``None``: the row's position)."""
    for field in fields:
        value = row.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
            raise ConfigError(f"{where}: field {field!r}={value!r:.60} must be a string or integer")
        return str(value), field
    return str(position), None


def plain_problem(row: Mapping[str, Any], where: str, position: int, seed: int = 0) -> Problem:
    """A ``{"problem", "answer"}`` row (plus any fields) as a ``Problem``."""
    problem = _text(row, "problem", where)
    answer = _answer(row, "answer", where)
    problem_id, id_field = _id(row, ("id", "unique_id"), where, position)
    fields = {k: v for k, v in row.items() if k not in ("problem", "answer", id_field)}
    return Problem(problem_id, problem, answer, fields)


def aime_problem(row: Mapping[str, Any], where: str, position: int, seed: int = 0) -> Problem:
    """An AIME row: a plain row whose answer is an integer 0-999 (kept without leading zeros)."""
    problem = plain_problem(row, where, position, seed)
    answer = problem.answer
    if not (answer.isascii() and answer.isdigit() and int(answer) <= 999):
        raise ConfigError(f"{where}: field 'answer'={answer!r} must be an integer 0-999 (AIME)")
    return attrs.evolve(problem, answer=str(int(answer)))


GPQA_INCORRECT = ("Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")


def gpqa_problem(row: Mapping[str, Any], where: str, position: int, seed: int = 0) -> Problem:
    """A GPQA row: the question and four options shuffled by ``seed`` and the id; the
    answer is the correct option's letter, the options are ``fields["choices"]``."""
    question = _text(row, "Question", where).strip()
    options = [_text(row, "Correct Answer", where).strip()]
    options += [_text(row, field, where).strip() for field in GPQA_INCORRECT]
    problem_id, _ = _id(row, ("Record ID", "id"), where, position)
    order = list(range(len(options)))
    random.Random(f"gpqa/{seed}/{problem_id}").shuffle(order)
    fields: dict[str, Any] = {"choices": tuple(options[i] for i in order)}
    for column, field in (("High-level domain", "domain"), ("Subdomain", "subject")):
        if row.get(column):
            fields[field] = row[column]
    return Problem(problem_id, question, LETTERS[order.index(0)], fields)


def problems_from_rows(
    rows: Iterable[tuple[str, Mapping[str, Any]]], convert: Convert = plain_problem, seed: int = 0
) -> tuple[Problem, ...]:
    """Each row converted; ids must not repeat."""
    problems: list[Problem] = []
    seen: dict[str, str] = {}
    for position, (where, row) in enumerate(rows):
        problem = convert(row, where, position, seed)
        if problem.id in seen:
            raise ConfigError(f"{where}: id {problem.id!r} repeats the one at {seen[problem.id]}")
        seen[problem.id] = where
        problems.append(problem)
    return tuple(problems)


# ---------------------------------------------------------------------- the datasets


@attrs.frozen
class HubSource:
    """Where a dataset lives on the Hugging Face hub."""

    id: str
    split: str
    config: str | None = None


@attrs.frozen
class DatasetSpec:
    """A named dataset: where to find it, how to read its rows, word and grade its problems."""

    name: str
    convert: Convert
    template: PromptTemplate = MATH
    grading: str = "math-verify"
    hub: HubSource | None = None
    """Loaded from here when no path is given (``None``: a path is required)."""


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec("math500", plain_problem, hub=HubSource("HuggingFaceH4/MATH-500", "test")),
        DatasetSpec("aime2024", aime_problem, hub=HubSource("HuggingFaceH4/aime_2024", "train")),
        DatasetSpec("aime2025", aime_problem, hub=HubSource("math-ai/aime25", "test")),
        DatasetSpec(
            "gpqa-diamond",
            gpqa_problem,
            MULTIPLE_CHOICE,
            "choice",
            HubSource("Idavidrein/gpqa", "train", "gpqa_diamond"),
        ),
        DatasetSpec("jsonl", plain_problem),
    )
}
"""The stock datasets by name."""


def load_dataset(
    name: str, path: str | Path | None = None, *, seed: int = 0, limit: int | None = None
) -> Dataset:
    """Dataset ``name`` (a key of ``DATASETS``) from ``path``, or from the hub when
    ``path`` is ``None``; ``seed`` shuffles multiple-choice options; ``limit`` keeps
    the first problems."""
    spec = DATASETS.get(name)
    if spec is None:
        raise ConfigError(f"dataset={name!r} must be one of {', '.join(DATASETS)}")
    if path is not None:
        rows: Iterable[tuple[str, Mapping[str, Any]]] = read_rows(path)
        source = str(path)
    elif spec.hub is not None:
        rows = hub_rows(spec.hub.id, spec.hub.split, spec.hub.config, name=name)
        source = f"hf:{spec.hub.id}"
    else:
        raise ConfigError(f"dataset {name!r} needs a path (it is not on the hub)")
    problems = problems_from_rows(rows, spec.convert, seed)
    if not problems:
        raise ConfigError(f"{source}: no problems")
    dataset = Dataset(name, problems, spec.template, spec.grading, source)
    return dataset if limit is None else dataset.head(limit)


TESTBED_TEMPLATE = PromptTemplate("{problem}")
"""The testbed's questions are their own prompts (``Q 3 p1 7 p2 5 p3 S``)."""


def load_testbed(count: int, seed: int = 0, name: str = "testbed") -> Dataset:
    """``count`` questions of the testbed ``name`` (``testbed``, ``testbed-long``), of
    mixed difficulty (``Testbed.questions(dataset_seed + seed, count)``; the first
    ``k`` of them are those of ``count=k``), ids ``t0``, ``t1``... as ``sart bench
    --model testbed`` names them, ``level`` their difficulty (digits to add), graded
    exactly. The long testbed's seed is set apart from those its training and
    report draw from, and its report's questions are left out (``Testbed.held_apart``)."""
    from sart.testbed.specs import TESTBEDS

    config_check(isinstance(count, int) and count >= 1, "limit", count, ">= 1")
    bed = TESTBEDS[name]
    problems = [
        Problem(f"t{i}", q.prompt, q.answer, {"level": q.difficulty})
        for i, q in enumerate(bed.eval_questions(count, seed))
    ]
    # What drew them: the long testbed's leave out its report's questions. Not how many:
    # the source is a recording setting, and a larger --limit extends a recording (its
    # first questions are the smaller one's), which a count here refused.
    spec = "SHORT" if name == "testbed" else "LONG"
    source = f"sart.testbed.{spec}.eval_questions(seed={seed})"
    return Dataset(name, problems, TESTBED_TEMPLATE, "exact", source)


_COUNTED_SOURCE = re.compile(r"(sart\.testbed\.\w+\.eval_questions)\(\d+, (-?\d+)\)")


def upgrade_recording(settings: dict[str, Any]) -> dict[str, Any]:
    """A recording's settings as this sart writes them: a testbed's source named its
    question count before (``eval_questions(40, 0)``), which a larger ``--limit`` does
    not change; it is ``eval_questions(seed=0)`` now."""
    source = settings.get("source")
    match = _COUNTED_SOURCE.fullmatch(source) if isinstance(source, str) else None
    if match is None:
        return settings
    return settings | {"source": f"{match[1]}(seed={match[2]})"}


def load_jsonl(
    path: str | Path, *, template: PromptTemplate = MATH, grading: str = "math-verify"
) -> Dataset:
    """A user's JSONL file of ``{"problem", "answer"}`` rows (plus any fields)."""
    return attrs.evolve(load_dataset("jsonl", path), template=template, grading=grading)


__all__ = [
    "DATASETS",
    "GRADINGS",
    "Dataset",
    "DatasetSpec",
    "HubSource",
    "Problem",
    "aime_problem",
    "gpqa_problem",
    "hub_rows",
    "load_dataset",
    "load_jsonl",
    "load_testbed",
    "plain_problem",
    "problems_from_rows",
    "read_rows",
]
