"""The testbed tokenizer: words in, words out, steps and answers survive decoding."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from sart.answers import extract_answer
from sart.prm.aggregate import split_steps
from sart.testbed.tasks import MAX_DIGITS, Question, clean_trace, noisy_trace
from sart.testbed.tokenizer import EOS, PRM_SEPARATOR, WORDS, build_tokenizer

TOKENIZER = build_tokenizer()
questions = st.lists(st.integers(0, 9), min_size=1, max_size=MAX_DIGITS).map(Question)


def test_vocabulary_is_small_and_word_level() -> None:
    assert 30 <= len(TOKENIZER) <= 45
    ids = TOKENIZER("Q p1 3 p2 7 S")["input_ids"]
    assert TOKENIZER.convert_ids_to_tokens(ids) == ["Q", "p1", "3", "p2", "7", "S"]
    # "\n\n" is one word, and nothing unknown appears in any word of the task.
    assert TOKENIZER.convert_ids_to_tokens(TOKENIZER("=\n\n=")["input_ids"]) == ["[UNK]"]
    assert len(TOKENIZER("\n\n")["input_ids"]) == 1
    assert TOKENIZER.unk_token_id not in TOKENIZER(" ".join(WORDS))["input_ids"]
    assert TOKENIZER.eos_token == EOS and TOKENIZER.pad_token_id == TOKENIZER.eos_token_id


def test_no_special_tokens_are_added_on_encoding() -> None:
    # sart's engines call tokenizer(prompt) with special tokens on: the same ids.
    with_special = TOKENIZER("Q p1 3 S")["input_ids"]
    assert with_special == TOKENIZER("Q p1 3 S", add_special_tokens=False)["input_ids"]


def test_prm_separator_is_one_special_token() -> None:
    ids = TOKENIZER.encode(PRM_SEPARATOR, add_special_tokens=False)
    assert len(ids) == 1 and PRM_SEPARATOR in TOKENIZER.all_special_tokens


def test_chat_template_joins_contents_with_spaces() -> None:
    messages = [
        {"role": "user", "content": "Q p1 3 S"},
        {"role": "assistant", "content": "p1 0 + 3 = 3"},
    ]
    text = TOKENIZER.apply_chat_template(messages, tokenize=False)
    assert text == "Q p1 3 S p1 0 + 3 = 3"


@settings(max_examples=50)
@given(questions, st.integers(0, 2**32 - 1))
def test_decode_round_trips_steps_and_answer(q: Question, seed: int) -> None:
    text = noisy_trace(q, random.Random(seed))
    ids = [*TOKENIZER(text)["input_ids"], TOKENIZER.eos_token_id]
    decoded = TOKENIZER.decode(ids, skip_special_tokens=True)
    assert decoded == text
    assert split_steps(decoded) == split_steps(text)
    assert extract_answer(decoded) == extract_answer(text)
    # Token by token (as a streaming engine decodes) gives the same words.
    assert " ".join(TOKENIZER.decode([i]) for i in ids[:-1]) == text


def test_saved_tokenizer_loads_with_auto_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    TOKENIZER.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = clean_trace(Question((3, 7, 5)))
    assert loaded(text)["input_ids"] == TOKENIZER(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.chat_template == TOKENIZER.chat_template
