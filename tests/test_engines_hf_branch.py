"""A branch as the transformers engine holds it (``sart.engines.hf_branch``): its KV's
length, and next-token logits kept as a row of a step's until read."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sart.engines.hf_branch import Branch, PromptKV  # noqa: E402
from sart.engines.hf_kv import Span  # noqa: E402
from sart.engines.ledger import Prefix  # noqa: E402
from sart.types import SamplingSettings  # noqa: E402


def branch() -> Branch:
    kv = [(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))]
    prefix = Prefix(3, SamplingSettings(), PromptKV(kv, torch.tensor([0.5, 1.5])))
    return Branch(prefix, Span(kv, 0, 0, 3), prefix.data.logits, [], "", seed=7)


def test_a_new_branchs_kv_is_its_prompts_and_grows_with_its_span() -> None:
    b = branch()
    assert (b.length, b.own) == (3, 0)
    step = [(torch.zeros(4, 1, 9, 2), torch.zeros(4, 1, 9, 2))]
    b.span = Span(step, 2, 4, 9)  # its row of a step batch, one token generated and one new
    assert (b.length, b.own) == (5, 2)
    b.span = None  # paused: no KV held
    assert (b.length, b.own) == (3, 0)


def test_its_logits_are_a_row_of_the_steps_taken_when_read() -> None:
    b = branch()
    assert b.logits.tolist() == [0.5, 1.5]
    step = torch.arange(12.0).view(3, 4)
    b.logits_in(step, 1)
    assert b.logits.tolist() == [4.0, 5.0, 6.0, 7.0]
    b.logits = torch.tensor([9.0])  # its own again (a resumed branch's)
    assert b.logits.tolist() == [9.0]
