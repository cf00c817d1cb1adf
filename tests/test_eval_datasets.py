"""Benchmark datasets and prompt templates: the shared MATH-500 and AIME files, GPQA's
shuffled options, user JSONL, malformed rows named by file, line and field, the hub."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from sart.errors import ConfigError, MissingDependencyError
from sart.eval import DATASETS, Dataset, Problem, PromptTemplate, load_dataset, load_jsonl
from sart.eval.prompts import MATH, MULTIPLE_CHOICE, R1_INSTRUCTION, render_prompt

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def shared(relative: str) -> Path:
    """A file of the shared evaluation data, or a skip where that folder is absent."""
    path = SHARED_DATA / relative
    if not path.is_file():
        pytest.skip(
            f"{path} is absent: the real benchmark files live beside the project "
            "(../shared/data), not in a clone of it"
        )
    return path


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------- the shared files


def test_math500_loads_all_500_problems_with_their_fields() -> None:
    data = load_dataset("math500", shared("math500/test.jsonl"))
    assert len(data) == 500 and data.grading == "math-verify" and data.template == MATH
    assert [p.id for p in data][:3] == ["0", "1", "2"]  # no id in the file: positions
    first = data.problems[0]
    assert first.answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert first.fields["subject"] == "Precalculus" and first.fields["level"] == 2
    assert "solution" in first.fields and "problem" not in first.fields
    assert {p.fields["level"] for p in data} == {1, 2, 3, 4, 5}
    assert all(p.answer and p.answer == p.answer.strip() for p in data)
    prompt = data.prompt(first)
    assert prompt == first.problem + "\n\n" + R1_INSTRUCTION
    assert prompt.endswith("put your final answer within \\boxed{}.")


def test_aime2024_answers_are_integers_and_ids_come_from_the_file() -> None:
    data = load_dataset("aime2024", shared("aime2024/test.jsonl"))
    assert len(data) == 30
    assert data.problems[0].id == "60" and data.problems[0].answer == "204"
    assert all(p.answer.isdigit() and 0 <= int(p.answer) <= 999 for p in data)
    assert set(data.problems[0].fields) == {"solution", "url"}


def test_a_limit_keeps_the_first_problems() -> None:
    data = load_dataset("math500", shared("math500/test.jsonl"), limit=5)
    assert [p.id for p in data] == ["0", "1", "2", "3", "4"]
    with pytest.raises(ConfigError, match="limit=0 must be >= 1"):
        data.head(0)


# ----------------------------------------------------------------------- user JSONL


def test_user_jsonl_keeps_extra_fields_and_takes_integer_answers(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text(
        json.dumps({"problem": "1+1?", "answer": 2, "topic": "sums"})
        + "\n\n"
        + json.dumps({"id": "b", "problem": "Half?", "answer": " \\frac12 "})
        + "\n",
        encoding="utf-8",
    )
    data = load_jsonl(path)
    assert data.problems == (
        Problem("0", "1+1?", "2", {"topic": "sums"}),
        Problem("b", "Half?", "\\frac12"),
    )
    assert data.source == str(path) and data.name == "jsonl"
    exact = load_jsonl(path, grading="exact")
    assert exact.grading == "exact"
    with pytest.raises(ConfigError, match="grading='fuzzy' must be one of"):
        load_jsonl(path, grading="fuzzy")


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("mine.jsonl", b'{"problem": "p", "answer": "1"}\n{"problem": "\xe9"}\n', r"\.jsonl:2: "),
        ("bom.jsonl", b'\xff\xfe{"problem": "p", "answer": "1"}\n', r"\.jsonl:1: "),
        ("mine.csv", b"problem,answer\np,1\ncaf\xe9,2\n", r"\.csv:\d: "),
    ],
)
def test_a_file_that_is_not_utf8_is_refused_with_its_line(
    tmp_path: Path, name: str, data: bytes, message: str
) -> None:
    # A Latin-1 or UTF-16 --data file ended in a UnicodeDecodeError traceback.
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=message + "not UTF-8 text"):
        load_jsonl(path)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"problem": "p", "answer": "1"}', "{oops"], r"mine\.jsonl:2: not valid JSON"),
        (['{"problem": "p"}'], r"mine\.jsonl:1: field 'answer' is missing"),
        (['{"answer": "1"}'], r"mine\.jsonl:1: field 'problem' is missing"),
        (['{"problem": "p", "answer": ["1"]}'], r":1: field 'answer'=\['1'\] must be a non-empty"),
        (['{"problem": "p", "answer": true}'], r":1: field 'answer'=True must be a non-empty"),
        (['{"problem": "  ", "answer": "1"}'], r":1: field 'problem'='  ' must be a non-empty"),
        (['{"problem": "p", "answer": "1", "id": 1.5}'], r":1: field 'id'=1.5 must be a string"),
        (['["p", "1"]'], r"mine\.jsonl:1: a row must be a JSON object"),
        (
            [
                '{"id": 7, "problem": "p", "answer": "1"}',
                "",
                '{"id": "7", "problem": "q", "answer": "2"}',
            ],
            r"mine\.jsonl:3: id '7' repeats the one at .*mine\.jsonl:1",
        ),
        ([""], r"mine\.jsonl: no problems"),
    ],
)
def test_malformed_rows_name_the_file_the_line_and_the_field(
    tmp_path: Path, lines: list[str], message: str
) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        load_jsonl(path)


def test_aime_answers_must_be_integers(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "aime.jsonl",
        [{"id": 1, "problem": "p", "answer": "007"}, {"id": 2, "problem": "q", "answer": 12}],
    )
    assert [p.answer for p in load_dataset("aime2025", path)] == ["7", "12"]
    write_jsonl(path, [{"id": 1, "problem": "p", "answer": "\\frac12"}])
    with pytest.raises(
        ConfigError, match=r"aime\.jsonl:1: field 'answer'='\\\\frac12' must be an integer 0-999"
    ):
        load_dataset("aime2024", path)


def test_unknown_names_and_missing_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dataset='math5000' must be one of math500, aime2024"):
        load_dataset("math5000")
    with pytest.raises(ConfigError, match="no such file"):
        load_dataset("math500", tmp_path / "absent.jsonl")
    with pytest.raises(ConfigError, match="dataset 'jsonl' needs a path"):
        load_dataset("jsonl")


# ----------------------------------------------------------------------------- GPQA

GPQA_COLUMNS = (
    ["Record ID", "Question", "Correct Answer"]
    + [f"Incorrect Answer {i}" for i in (1, 2, 3)]
    + ["High-level domain", "Subdomain"]
)


def gpqa_rows(count: int) -> list[dict[str, str]]:
    return [
        {
            "Record ID": f"rec{i}",
            "Question": f"Question {i}?\nIt spans two lines.",
            "Correct Answer": f"right {i}\n",
            "Incorrect Answer 1": f"wrong {i}.1",
            "Incorrect Answer 2": f"wrong {i}.2",
            "Incorrect Answer 3": f"wrong {i}.3",
            "High-level domain": "Physics",
            "Subdomain": "Optics",
        }
        for i in range(count)
    ]


def write_gpqa_csv(path: Path, rows: list[dict[str, str]]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=GPQA_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_gpqa_shuffles_options_by_seed_and_id_and_answers_with_a_letter(tmp_path: Path) -> None:
    rows = gpqa_rows(40)
    data = load_dataset("gpqa-diamond", write_gpqa_csv(tmp_path / "gpqa.csv", rows))
    assert data.grading == "choice" and data.template == MULTIPLE_CHOICE and len(data) == 40
    for problem in data:
        i = int(problem.id.removeprefix("rec"))
        choices = problem.fields["choices"]
        assert sorted(choices) == sorted([f"right {i}", *(f"wrong {i}.{k}" for k in (1, 2, 3))])
        assert choices["ABCD".index(problem.answer)] == f"right {i}"
        assert problem.fields["domain"] == "Physics" and problem.fields["subject"] == "Optics"
    assert {p.answer for p in data} == set("ABCD")
    # The same seed gives the same letters whatever the file's order or format...
    reordered = load_dataset(
        "gpqa-diamond", write_jsonl(tmp_path / "gpqa.jsonl", list(reversed(rows)))
    )
    assert {p.id: p for p in reordered} == {p.id: p for p in data}
    # ...and another seed other letters.
    reseeded = load_dataset("gpqa-diamond", tmp_path / "gpqa.csv", seed=1)
    assert [p.answer for p in reseeded] != [p.answer for p in data]
    prompt = data.prompt(data.problems[0])
    assert prompt.startswith("Question 0?\nIt spans two lines.\n\nA) ")
    assert "\nD) " in prompt and prompt.endswith("(A, B, C or D) within \\boxed{}.")


def test_a_malformed_gpqa_record_is_named_by_its_first_line(tmp_path: Path) -> None:
    rows = gpqa_rows(3)
    rows[2]["Incorrect Answer 2"] = ""
    path = write_gpqa_csv(tmp_path / "gpqa.csv", rows)
    # Header on line 1, then records of three lines each (the question and the
    # correct answer hold a newline): the third record starts on line 8.
    with pytest.raises(ConfigError, match=r"gpqa\.csv:8: field 'Incorrect Answer 2'=''"):
        load_dataset("gpqa-diamond", path)


# ----------------------------------------------------------------------- the hub


def test_the_hub_without_datasets_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingDependencyError, match=r"dataset 'math500'.*'\.\[eval\]'") as info:
        load_dataset("math500")
    assert isinstance(info.value.__cause__, ImportError)


def test_the_hub_rows_go_through_the_same_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_load_dataset(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
        calls.append((name, config, split))
        if name == "Idavidrein/gpqa":
            return gpqa_rows(2)
        return [
            {"problem": "p", "answer": "1", "unique_id": "test/algebra/1.json", "level": 1},
            {"problem": "q", "unique_id": "test/algebra/2.json"},
        ]

    monkeypatch.setitem(
        sys.modules, "datasets", types.SimpleNamespace(load_dataset=fake_load_dataset)
    )
    with pytest.raises(ConfigError, match=r"HuggingFaceH4/MATH-500 \(test\) row 1: field 'answer'"):
        load_dataset("math500")
    gpqa = load_dataset("gpqa-diamond")
    assert gpqa.source == "hf:Idavidrein/gpqa" and [p.id for p in gpqa] == ["rec0", "rec1"]
    assert calls == [
        ("HuggingFaceH4/MATH-500", None, "test"),
        ("Idavidrein/gpqa", "gpqa_diamond", "train"),
    ]
    assert {name: spec.hub.id for name, spec in DATASETS.items() if spec.hub} == {
        "math500": "HuggingFaceH4/MATH-500",
        "aime2024": "HuggingFaceH4/aime_2024",
        "aime2025": "math-ai/aime25",
        "gpqa-diamond": "Idavidrein/gpqa",
    }


def test_the_hub_out_of_reach_points_to_a_local_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: datasets' ConnectionError as a 14-frame traceback, with no word of --data.
    def unreachable(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=unreachable))
    with pytest.raises(ConfigError) as info:
        load_dataset("math500")
    assert str(info.value) == (
        "dataset 'math500': could not be read from the Hugging Face hub (Couldn't reach "
        "'HuggingFaceH4/MATH-500' on the Hub (OfflineModeIsEnabled)); give a local copy "
        "instead (sart eval --data FILE)"
    )


# -------------------------------------------------------------------------- prompts


class ChatTokenizer:
    """Records what it is asked, as a transformers tokenizer's chat template would be."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[dict[str, str]], dict[str, Any]]] = []

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        self.calls.append((messages, kwargs))
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_templates_fill_their_placeholders_only() -> None:
    problem = Problem("x", "Is {choices} a set? Find $\\{1\\}$.", "B", {"choices": ("yes", "no")})
    template = PromptTemplate("Q: {problem}\n{choices}\nBox it: \\boxed{}")
    assert template.render(problem) == (
        "Q: Is {choices} a set? Find $\\{1\\}$.\nA) yes\nB) no\nBox it: \\boxed{}"
    )
    with pytest.raises(ConfigError, match=re.escape("must be a string with a {problem} place")):
        PromptTemplate("no placeholder")
    with pytest.raises(ConfigError, match=re.escape("problem 'y': the template lists {choices}")):
        MULTIPLE_CHOICE.render(Problem("y", "q", "A"))


def test_a_chat_template_wraps_the_rendered_prompt() -> None:
    problem = Problem("x", "What is 1+1?", "2")
    tokenizer = ChatTokenizer()
    assert render_prompt(problem, MATH, tokenizer) == (
        f"<user>What is 1+1?\n\n{R1_INSTRUCTION}<assistant>"
    )
    assert tokenizer.calls[0][1] == {"add_generation_prompt": True, "tokenize": False}
    with_system = PromptTemplate("{problem}", system="Be brief.")
    assert render_prompt(problem, with_system, tokenizer) == (
        "<system>Be brief.<user>What is 1+1?<assistant>"
    )
    assert render_prompt(problem, with_system) == "What is 1+1?"  # no tokenizer: plain text
    data = Dataset("mine", [problem])
    assert data.prompt(problem, tokenizer) == render_prompt(problem, MATH, tokenizer)


def test_importing_sart_eval_loads_neither_math_verify_nor_datasets() -> None:
    code = (
        "import sart, sart.eval, sart.eval.grading, sart.eval.equivalence, sys; "
        "print(sorted(m for m in ('math_verify', 'sympy', 'datasets', 'torch', "
        "'latex2sympy2_extended') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_long_testbeds_dataset_is_held_apart_and_graded_exactly() -> None:
    from sart.eval.datasets import load_testbed
    from sart.testbed import LONG, Question, grade, make_questions

    dataset = load_testbed(200, 0, "testbed-long")
    assert dataset.name == "testbed-long" and dataset.grading == "exact"
    problems = dataset.problems
    assert [p.id for p in problems[:3]] == ["t0", "t1", "t2"]
    assert sorted({p.fields["level"] for p in problems}) == list(LONG.difficulties)
    # Drawn from a seed of its own: none of the report's questions (seed 0) is among them.
    report = {q.prompt for q in LONG.questions(0, 200)}
    assert not report & {p.problem for p in problems}
    question = Question.from_prompt(problems[5].problem)
    assert grade(question, f"answer \\boxed{{ {problems[5].answer} }}")
    # The first k of a larger set are the set of k; the short testbed's is unchanged.
    assert load_testbed(10, 0, "testbed-long").problems == problems[:10]
    short = load_testbed(4)
    assert [p.problem for p in short.problems] == [q.prompt for q in make_questions(0, 4)]
