"""The documentation runs: every ``python`` code block under ``docs/`` is executed.

Rules for people writing docs:

- A fenced block whose info string is ``python`` (or ``py``) is executed. Fences
  are three or more backticks or tildes at the start of a line; blocks indented
  inside lists or admonitions are not found, so keep runnable code at top level.
  Superfences options such as ``title="x.py"`` may follow the language.
- The blocks of one markdown file run in order, in one fresh module namespace
  (so classes and ``dataclasses`` defined there work as in a script). Files do not
  share anything. ``assert`` in a block is how a tutorial states its claims.
- To show a python block without running it, put this line directly above its
  opening fence; it renders as nothing::

      <!-- docs-test: skip -->

  (An info string such as ``python skip`` is refused: mkdocs does not recognise
  that fence and renders the block as garbled paragraphs.)

Also checked: the tutorials hold at least one runnable block, every page in
the ``mkdocs.yml`` nav exists, and the API reference names every public name.
"""

from __future__ import annotations

import re
import sys
import traceback
import types
from pathlib import Path

import attrs
import pytest

import sart
import sart.testing

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SKIP_MARKER = "<!-- docs-test: skip -->"
PYTHON_LANGS = frozenset({"python", "py"})

_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_OPTION = re.compile(r"""^[A-Za-z_][\w-]*=(?:"[^"]*"|'[^']*'|\S+)$""")


@attrs.frozen
class Block:
    """One fenced python block of a markdown file."""

    line: int
    """1-based line number of the opening fence."""
    code: str
    skip: bool


def python_blocks(text: str, name: str = "<markdown>") -> list[Block]:
    """The fenced python blocks of ``text``, in order; ``name`` is used in errors."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, info = opening["fence"], opening["info"].strip()
        if fence[0] == "`" and "`" in info:
            i += 1  # inline code such as ```x```, not a fence
            continue
        start = i
        i += 1
        while i < len(lines) and not _closes(lines[i], fence):
            i += 1
        if i == len(lines):
            raise AssertionError(f"{name}:{start + 1}: code fence {fence!r} is never closed")
        words = info.split()
        if words and words[0].lower() in PYTHON_LANGS:
            odd = [w for w in words[1:] if not _OPTION.match(w)]
            if odd:
                raise AssertionError(
                    f"{name}:{start + 1}: fence info {info!r} has {odd}, which mkdocs does not "
                    f"render; to skip a block put {SKIP_MARKER} on the line above the fence"
                )
            skip = start > 0 and lines[start - 1].strip() == SKIP_MARKER
            blocks.append(Block(start + 1, "\n".join(lines[start + 1 : i]), skip))
        i += 1
    return blocks


def _closes(line: str, fence: str) -> bool:
    stripped = line.rstrip()
    return (
        len(stripped) >= len(fence) and set(stripped) == {fence[0]} and stripped.startswith(fence)
    )


def _doc_files() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", _doc_files(), ids=_rel)
def test_doc_code_blocks_run(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rel = _rel(path)
    blocks = python_blocks(path.read_text(encoding="utf-8"), rel)
    module_name = "sart_docs_" + re.sub(r"\W", "_", rel)
    module = types.ModuleType(module_name)
    module.__file__ = str(path)
    monkeypatch.setitem(sys.modules, module_name, module)
    # Pages register engines, PRMs and methods of their own: each page gets the registries back
    # as it found it, so that no page changes what another test sees.
    from sart import methods, registry

    for table in ("_ENGINES", "_PRMS", "_ENGINE_BUILDERS", "_PRM_BUILDERS", "_STREAMING"):
        monkeypatch.setattr(
            registry, table, type(getattr(registry, table))(getattr(registry, table))
        )
    monkeypatch.setattr(methods, "_METHODS", dict(methods._METHODS))  # methods too
    for block in blocks:
        if block.skip:
            continue
        # Pad with blank lines so that tracebacks show the markdown file's line numbers.
        source = "\n" * block.line + block.code
        failure = None
        try:
            exec(compile(source, str(path), "exec"), module.__dict__)
        except Exception as exc:
            extra = missing_extra(exc)
            if extra is not None:  # as the other tests of optional extras do
                pytest.skip(f"{rel}: the block at line {block.line} needs {extra} (not installed)")
            # Drop this function's frame: the traceback starts in the markdown file.
            tb = exc.__traceback__.tb_next if exc.__traceback__ else None
            failure = "".join(traceback.format_exception(type(exc), exc, tb))
        if failure is not None:
            pytest.fail(
                f"{rel}: the python block starting at line {block.line} failed "
                f"(the blocks of a file run in order in one namespace):\n\n{failure}",
                pytrace=False,
            )


#: Top-level modules of sart's optional extras (pyproject.toml): a page that needs
#: one is skipped where it is not installed, not failed.
OPTIONAL_MODULES = frozenset(
    {"torch", "transformers", "tokenizers", "vllm", "sglang", "fastapi", "uvicorn", "httpx"}
    | {"rich", "matplotlib"}
    | {"math_verify", "datasets"}
)


def missing_extra(exc: BaseException) -> str | None:
    """The optional module whose absence raised ``exc`` (directly, or as the cause of
    sart's ``MissingDependencyError``), if that is what happened."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ModuleNotFoundError):
            top = (seen.name or "").split(".")[0]
            if top in OPTIONAL_MODULES:
                return top
        seen = seen.__cause__
    return None


def test_missing_extras_are_told_apart_from_broken_imports() -> None:
    # Before: without torch, three pages failed instead of being skipped.
    torch_missing = ModuleNotFoundError("No module named 'torch'", name="torch")
    wrapped = sart.MissingDependencyError("sart.prm.hf needs torch")
    wrapped.__cause__ = torch_missing
    assert missing_extra(torch_missing) == "torch"
    assert missing_extra(wrapped) == "torch"
    assert missing_extra(ModuleNotFoundError("x", name="transformers.models")) == "transformers"
    assert missing_extra(ModuleNotFoundError("typo", name="sart.tpyo")) is None
    assert missing_extra(ValueError("unrelated")) is None


def test_tutorials_have_runnable_code() -> None:
    runnable = [
        block
        for path in sorted((DOCS / "tutorials").rglob("*.md"))
        for block in python_blocks(path.read_text(encoding="utf-8"), _rel(path))
        if not block.skip
    ]
    assert runnable, "docs/tutorials/ has no runnable python block; tutorials must run as tests"


def _nav_pages(config: str) -> list[str]:
    """Page paths named in the ``nav:`` section of an mkdocs.yml (no YAML parser needed)."""
    lines = config.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"^nav:\s*$", line))
    pages = []
    for line in lines[start + 1 :]:
        if line.strip() and not line.startswith((" ", "-", "#")):
            break  # the next top-level key
        match = re.search(r"(?:^\s*-|:)\s*([\w./-]+\.md)\s*$", line)
        if match:
            pages.append(match.group(1))
    return pages


def test_mkdocs_nav_pages_exist() -> None:
    pages = _nav_pages((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert pages, "mkdocs.yml has a nav with no pages"
    missing = [page for page in pages if not (DOCS / page).is_file()]
    assert not missing, f"mkdocs.yml nav names pages that do not exist under docs/: {missing}"


def test_every_page_is_in_the_nav_and_linked_from_the_index() -> None:
    pages = set(_nav_pages((ROOT / "mkdocs.yml").read_text(encoding="utf-8")))
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert not on_disk - pages, f"pages missing from the mkdocs.yml nav: {on_disk - pages}"
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    unlinked = sorted(p for p in pages - {"index.md"} if f"]({p})" not in index)
    assert not unlinked, f"docs/index.md does not link {unlinked}"


def test_api_reference_names_every_registered_engine_and_prm() -> None:
    from sart.registry import _ENGINES, _PRMS

    text = (DOCS / "reference" / "api.md").read_text(encoding="utf-8")
    for table in (_ENGINES, _PRMS):
        for name, target in table.items():
            module, _, cls = target.partition(":")
            # By its module path, or by its public home (sart.testing re-exports the fakes).
            paths = (f"`{module}.{cls}`", f"`sart.testing.{cls}`")
            assert any(p in text for p in paths), f"docs/reference/api.md lacks {target}"
            assert f'`"{name}"`' in text, f"docs/reference/api.md does not name {name!r}"


def test_api_reference_names_every_public_name() -> None:
    text = (DOCS / "reference" / "api.md").read_text(encoding="utf-8")
    names = [f"sart.{n}" for n in sart.__all__] + [
        f"sart.testing.{n}" for n in sart.testing.__all__
    ]
    missing = [name for name in names if f"`{name}`" not in text]
    assert not missing, f"docs/reference/api.md does not document {missing}"


# ----------------------------------------------------------- the block finder itself


def test_python_blocks_finds_lines_languages_and_skips() -> None:
    text = "\n".join(
        [
            "# Title",  # 1
            "```python",  # 2
            "a = 1",  # 3
            "```",  # 4
            "```text",  # 5
            "not code",  # 6
            "```",  # 7
            SKIP_MARKER,  # 8
            "```python",  # 9
            "raise SystemExit",  # 10
            "```",  # 11
            '~~~~py title="b.py"',  # 12
            "```",  # 13: inside a tilde fence, not a fence
            "~~~~",  # 14
            "````python",  # 15
            "b = 2",  # 16
            "```",  # 17: too short to close
            "````",  # 18
        ]
    )
    blocks = python_blocks(text)
    assert [(b.line, b.code, b.skip) for b in blocks] == [
        (2, "a = 1", False),
        (9, "raise SystemExit", True),
        (12, "```", False),
        (15, "b = 2\n```", False),
    ]


def test_python_blocks_refuses_unrendered_info_and_open_fences() -> None:
    with pytest.raises(AssertionError, match="does not render"):
        python_blocks("```python skip\nx = 1\n```\n", "x.md")
    with pytest.raises(AssertionError, match=r"x\.md:1: code fence .* never closed"):
        python_blocks("```python\nx = 1\n", "x.md")


def test_nav_pages_reads_nested_sections() -> None:
    config = "\n".join(
        [
            "site_name: s",
            "nav:",
            "  - Home: index.md",
            "  - Tutorials:",
            "      - Write a rule: tutorials/custom-pruning.md",
            "      - how-to/x.md",
            "theme:",
            "  name: material",
            "  logo: not-a-page.md",
        ]
    )
    assert _nav_pages(config) == ["index.md", "tutorials/custom-pruning.md", "how-to/x.md"]
