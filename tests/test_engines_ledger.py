"""The prefix ledger: every check and error once, and random operation sequences
against a model (no branch leaks, no invalid transition accepted). Pure Python."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import sart
from sart.engines.base import BranchSpec
from sart.engines.ledger import Prefix, PrefixLedger, cap_max_tokens
from sart.errors import EngineMisuse
from sart.types import BranchId, SamplingSettings
from strategies import examples

SAMPLING = SamplingSettings(max_tokens=16)
A0, A1, A2 = (BranchId("a", j) for j in range(3))


def held(strict: bool = False, tokens: int = 10) -> PrefixLedger[str, str]:
    """A ledger holding request "a" (``tokens`` prompt tokens) with branches 0 and 1 live."""
    ledger: PrefixLedger[str, str] = PrefixLedger(strict=strict)
    ledger.prefill("a", tokens, SAMPLING, "prompt-a")
    ledger.start("a", [(BranchSpec(0, 0), "b0"), (BranchSpec(1, 1), "b1")])
    return ledger


def snapshot(ledger: PrefixLedger[Any, Any]) -> tuple[object, ...]:
    rids = sorted(ledger.prefixes)
    return (
        dict(ledger.prefixes),
        dict(ledger.branches),
        {r: (ledger.started(r), ledger.live(r), ledger.lost(r)) for r in rids},
    )


MODES = pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])


@contextlib.contextmanager
def refused(ledger: PrefixLedger[Any, Any], match: str, request_id: str) -> Iterator[None]:
    """The call is refused as the ledger's mode says (``EngineMisuse``, or an
    ``EngineError`` naming ``request_id``) and changes nothing."""
    before = snapshot(ledger)
    kind = EngineMisuse if ledger.strict else sart.EngineError
    with pytest.raises(kind, match=match) as info:
        yield
    if not ledger.strict:
        assert info.value.request_ids == {request_id}
    assert snapshot(ledger) == before, "a refused call changed the ledger"


# ------------------------------------------------------------------ each check


def test_the_ledger_imports_no_torch_and_no_engine() -> None:
    code = (
        "import sys, sart.engines.ledger\n"
        "heavy = {'torch', 'transformers', 'vllm', 'sglang', 'httpx'} & set(sys.modules)\n"
        "engines = {m for m in sys.modules if m.startswith('sart.engines.')}\n"
        "assert not heavy, heavy\n"
        "assert engines == {'sart.engines.base', 'sart.engines.ledger'}, engines\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@MODES
def test_a_request_is_prefilled_once(strict: bool) -> None:
    ledger = held(strict)
    assert ledger.prefixes == {"a": Prefix(10, SAMPLING, "prompt-a")}
    with refused(ledger, "prefill of 'a', whose prefix is already held", "a"):
        ledger.prefill("a", 3, SAMPLING, "again")
    with refused(ledger, "already held", "a"):
        ledger.check_prefill("a")


@MODES
def test_branches_start_only_from_a_held_prefix(strict: bool) -> None:
    ledger = held(strict)
    with refused(ledger, "start_branches for 'zz', which has no prefix", "zz"):
        ledger.start("zz", [(BranchSpec(0, 0), "x")])
    with refused(ledger, "no prefix", "zz"):
        ledger.check_start("zz", [BranchSpec(0, 0)])
    assert ledger.check_start("a", [BranchSpec(2, 2)]) == ledger.prefixes["a"]


@MODES
def test_a_branch_index_starts_once_ever(strict: bool) -> None:
    ledger = held(strict)
    with refused(ledger, r"branches \[1\] of 'a' started twice", "a"):  # live
        ledger.start("a", [(BranchSpec(2, 2), "b2"), (BranchSpec(1, 1), "again")])
    ledger.end(A1)
    with refused(ledger, r"branches \[1\] of 'a' started twice", "a"):  # ended
        ledger.start("a", [(BranchSpec(1, 1), "again")])


@MODES
def test_the_same_index_twice_in_one_call_is_refused(strict: bool) -> None:
    ledger = held(strict)
    with refused(ledger, r"branches \[2, 3\] of 'a' started twice", "a"):
        specs = [BranchSpec(2, 2), BranchSpec(3, 3), BranchSpec(2, 4), BranchSpec(3, 5)]
        ledger.check_start("a", specs)
    assert 2 not in ledger.started("a")


@MODES
def test_a_fork_needs_a_live_parent(strict: bool) -> None:
    ledger = held(strict)
    ledger.start("a", [(BranchSpec(2, 2, parent=0), "fork")])
    assert ledger.branches[A2] == "fork"
    ledger.end(A0)
    with refused(ledger, "fork from branch 0_a, which is not live", "a"):  # ended
        ledger.start("a", [(BranchSpec(3, 3, parent=0), "x")])
    with refused(ledger, "fork from branch 7_a, which is not live", "a"):  # never started
        ledger.start("a", [(BranchSpec(3, 3, parent=7), "x")])
    with refused(ledger, "fork from branch 3_a, which is not live", "a"):  # started alongside
        ledger.start("a", [(BranchSpec(3, 3), "x"), (BranchSpec(4, 4, parent=3), "y")])
    ledger.lose(A1)
    with refused(ledger, "fork from branch 1_a, which is not live", "a"):  # lost
        ledger.start("a", [(BranchSpec(3, 3, parent=1), "x")])


@MODES
def test_a_start_is_all_or_nothing(strict: bool) -> None:
    ledger = held(strict)
    with refused(ledger, "fork from branch 9_a", "a"):
        ledger.start("a", [(BranchSpec(2, 2), "ok"), (BranchSpec(3, 3, parent=9), "bad")])
    ledger.start("a", [(BranchSpec(2, 2), "ok")])  # nothing of the refused call was kept
    assert ledger.live("a") == [A0, A1, A2]


@MODES
def test_abort_ends_live_branches_and_hands_them_back(strict: bool) -> None:
    ledger = held(strict)
    assert ledger.check_abort([A1, A0]) == [A1, A0]
    assert ledger.abort([A1]) == {A1: "b1"}
    assert ledger.live("a") == [A0]
    with refused(ledger, "abort of branch 1_a, which is not live", "a"):  # aborted
        ledger.abort([A0, A1])
    with refused(ledger, "abort of branch 5_a, which is not live", "a"):  # never started
        ledger.abort([BranchId("a", 5)])
    with refused(ledger, "abort of branch 0_zz, which is not live", "zz"):  # no prefix
        ledger.check_abort([BranchId("zz", 0)])
    with refused(ledger, "abort of branch 0_a twice in one call", "a"):
        ledger.abort([A0, A0])
    ledger.end(A0)
    with refused(ledger, "abort of branch 0_a, which is not live", "a"):  # ended
        ledger.abort([A0])


@MODES
def test_a_lost_branch_stays_abortable_once(strict: bool) -> None:
    ledger = held(strict)
    assert ledger.lose(A1) == "b1"
    assert list(ledger.branches) == [A0] and ledger.lost("a") == [A1]
    assert ledger.check_abort([A0, A1]) == [A0]  # only A0 still needs the engine
    assert ledger.abort([A0, A1]) == {A0: "b0"}
    assert ledger.lost("a") == []
    with refused(ledger, "abort of branch 1_a, which is not live", "a"):
        ledger.abort([A1])


@MODES
def test_release_needs_a_prefix(strict: bool) -> None:
    ledger = held(strict)
    with refused(ledger, "release_prefix of 'zz', which has no prefix", "zz"):
        ledger.release("zz")
    ledger.abort([A0, A1])
    assert ledger.release("a") == {}
    assert ledger.prefixes == {} and ledger.branches == {} and ledger.started("a") == set()
    with refused(ledger, "no prefix", "a"):
        ledger.release("a")
    ledger.prefill("a", 4, SAMPLING, "later")  # a released request id may come back
    ledger.start("a", [(BranchSpec(0, 0), "new")])


def test_strict_release_refuses_while_branches_are_live() -> None:
    ledger = held(strict=True)
    with refused(ledger, r"release_prefix of 'a' while branches \[0, 1\] are live", "a"):
        ledger.release("a")
    ledger.end(A0)
    ledger.lose(A1)  # a lost branch is not live: the release forgets it
    assert ledger.release("a") == {}
    assert ledger.lost("a") == []


def test_lenient_release_ends_the_live_branches_and_forgets_the_lost() -> None:
    ledger = held(strict=False)
    ledger.start("a", [(BranchSpec(2, 2), "b2")])
    ledger.lose(A2)
    assert ledger.check_release("a") == [A0, A1]
    assert ledger.release("a") == {A0: "b0", A1: "b1"}
    assert ledger.branches == {} and ledger.lost("a") == []


def test_end_and_lose_are_for_live_branches_only() -> None:
    ledger = held()
    assert ledger.end(A0) == "b0"
    with pytest.raises(KeyError):  # a bug in the adapter, not a refused call
        ledger.end(A0)
    with pytest.raises(KeyError):
        ledger.lose(BranchId("zz", 0))


def test_refusals_are_engine_errors_or_misuse_by_mode() -> None:
    lenient, strict = held(strict=False), held(strict=True)
    with pytest.raises(sart.EngineError) as info:
        lenient.abort([BranchId("b", 0)])
    assert info.value.request_ids == {"b"}
    assert not isinstance(info.value, AssertionError)
    with pytest.raises(AssertionError):  # the driver lets it through: a caller's bug
        strict.abort([BranchId("b", 0)])


def test_kv_tokens_and_usage() -> None:
    ledger: PrefixLedger[None, int] = PrefixLedger()
    assert ledger.kv_tokens(int) == 0 and ledger.usage("a", int) == (0, 0)
    ledger.prefill("a", 10, SAMPLING, None)
    ledger.prefill("b", 7, SAMPLING, None)
    ledger.start("a", [(BranchSpec(0, 0), 3), (BranchSpec(1, 1), 5)])
    ledger.start("b", [(BranchSpec(0, 0), 1)])
    assert ledger.kv_tokens(int) == 10 + 7 + 3 + 5 + 1
    assert ledger.usage("a", int) == (2, 18)
    ledger.lose(BranchId("a", 1))  # the engine freed it
    assert ledger.usage("a", int) == (1, 13)
    assert ledger.usage("zz", int) == (0, 0)


def test_cap_max_tokens() -> None:
    assert cap_max_tokens("r", 10, 100, None, "no limit") == 100
    assert cap_max_tokens("r", 10, 100, 50, "ctx") == 40
    assert cap_max_tokens("r", 10, 20, 50, "ctx") == 20
    for tokens in (0, 50, 60):
        with pytest.raises(sart.EngineError, match=f"a prompt of {tokens} tokens leaves no room"):
            cap_max_tokens("r", tokens, 100, 50, "max_model_len=50")
    with pytest.raises(sart.EngineError, match="in max_model_len=50") as info:
        cap_max_tokens("r", 50, 100, 50, "max_model_len=50")
    assert info.value.request_ids == {"r"}


# ---------------------------------------------------------- random sequences

RIDS = ("a", "b", "c")
INDICES = st.integers(0, 4)
SPECS = st.lists(
    st.builds(BranchSpec, INDICES, st.just(0), st.none() | INDICES), min_size=1, max_size=4
)
BRANCHES = st.builds(BranchId, st.sampled_from(RIDS), INDICES)


class LedgerMachine(RuleBasedStateMachine):
    """Every operation, valid or not, against a model of the contract: a valid one
    is accepted and does what the model does, an invalid one is refused and changes
    nothing; every payload started comes back exactly once (ended, lost, aborted or
    released), and nothing of a released request stays behind."""

    strict = False

    def __init__(self) -> None:
        super().__init__()
        self.ledger: PrefixLedger[str, object] = PrefixLedger(strict=self.strict)
        self.held: dict[str, tuple[set[int], set[int], set[int]]] = {}  # started, live, lost
        self.out: dict[BranchId, object] = {}  # payloads handed in, not yet handed back

    def attempt(self, name: str, valid: bool, call: Any) -> Any:
        event(f"{name} {'accepted' if valid else 'refused'}")
        before = snapshot(self.ledger)
        if valid:
            return call()
        kind = EngineMisuse if self.strict else sart.EngineError
        with pytest.raises(kind):
            call()
        assert snapshot(self.ledger) == before
        return None

    def hand_back(self, payloads: dict[BranchId, object]) -> None:
        for bid, payload in payloads.items():
            assert self.out.pop(bid) is payload

    @initialize()
    def hold_one(self) -> None:
        self.prefill("a", 5)

    @rule(rid=st.sampled_from(RIDS), tokens=st.integers(1, 9))
    def prefill(self, rid: str, tokens: int) -> None:
        valid = rid not in self.held
        self.attempt("prefill", valid, lambda: self.ledger.prefill(rid, tokens, SAMPLING, rid))
        if valid:
            self.held[rid] = (set(), set(), set())

    @rule(rid=st.sampled_from(RIDS), specs=SPECS)
    def start(self, rid: str, specs: list[BranchSpec]) -> None:
        indices = [s.index for s in specs]
        books = self.held.get(rid)
        valid = (
            books is not None
            and len(set(indices)) == len(indices)
            and not books[0] & set(indices)
            and all(s.parent is None or s.parent in books[1] for s in specs)
        )
        new = [(spec, object()) for spec in specs]
        self.attempt("start", valid, lambda: self.ledger.start(rid, new))
        if valid:
            assert books is not None
            books[0].update(indices)
            books[1].update(indices)
            self.out.update({BranchId(rid, s.index): payload for s, payload in new})

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def start_valid(self, data: st.DataObject) -> None:
        """Mostly-valid starts, so that the sequences grow (random ones are often refused)."""
        rid = data.draw(st.sampled_from(sorted(self.held)))
        started, live, _ = self.held[rid]
        fresh = [j for j in range(max(started, default=0) + 4) if j not in started]
        indices = data.draw(st.lists(st.sampled_from(fresh), min_size=1, max_size=3, unique=True))
        parents = st.none() | st.sampled_from(sorted(live)) if live else st.none()
        self.start(rid, [BranchSpec(j, j, data.draw(parents)) for j in indices])

    def live(self) -> list[BranchId]:
        return sorted(BranchId(r, j) for r, books in self.held.items() for j in books[1])

    @precondition(lambda self: self.live())
    @rule(data=st.data(), lose=st.booleans())
    def end(self, data: st.DataObject, lose: bool) -> None:
        bid = data.draw(st.sampled_from(self.live()))
        payload = (self.ledger.lose if lose else self.ledger.end)(bid)
        self.hand_back({bid: payload})
        _, live, lost = self.held[bid.request_id]
        live.discard(bid.index)
        if lose:
            lost.add(bid.index)

    @rule(bids=st.lists(BRANCHES, max_size=4))
    def abort(self, bids: list[BranchId]) -> None:
        def abortable(bid: BranchId) -> bool:
            books = self.held.get(bid.request_id)
            return books is not None and (bid.index in books[1] or bid.index in books[2])

        valid = all(map(abortable, bids)) and len(set(bids)) == len(bids)
        ended = self.attempt("abort", valid, lambda: self.ledger.abort(bids))
        if valid:
            self.hand_back(ended)
            for bid in bids:
                _, live, lost = self.held[bid.request_id]
                live.discard(bid.index)
                lost.discard(bid.index)

    @rule(rid=st.sampled_from(RIDS))
    def release(self, rid: str) -> None:
        books = self.held.get(rid)
        valid = books is not None and not (self.strict and books[1])
        ended = self.attempt("release", valid, lambda: self.ledger.release(rid))
        if valid:
            assert books is not None
            assert set(ended) == {BranchId(rid, j) for j in books[1]}
            self.hand_back(ended)
            del self.held[rid]

    @invariant()
    def agrees_with_the_model(self) -> None:
        assert set(self.ledger.prefixes) == set(self.held)
        for rid, (started, live, lost) in self.held.items():
            assert self.ledger.started(rid) == started
            assert self.ledger.live(rid) == [BranchId(rid, j) for j in sorted(live)]
            assert self.ledger.lost(rid) == [BranchId(rid, j) for j in sorted(lost)]

    @invariant()
    def no_branch_leaks(self) -> None:
        # Every live branch belongs to a held prefix, and the payloads the ledger
        # holds are exactly those handed in and not yet handed back.
        assert all(bid.request_id in self.held for bid in self.ledger.branches)
        assert dict(self.ledger.branches) == self.out
        for rid in set(RIDS) - set(self.held):
            assert not self.ledger.started(rid) and not self.ledger.lost(rid)
        assert self.ledger.kv_tokens(lambda _: 1) == (
            sum(p.tokens for p in self.ledger.prefixes.values()) + len(self.out)
        )


class StrictLedgerMachine(LedgerMachine):
    strict = True


LedgerMachine.TestCase.settings = settings(max_examples=examples(150), stateful_step_count=40)
StrictLedgerMachine.TestCase.settings = LedgerMachine.TestCase.settings
test_lenient_ledger_machine = LedgerMachine.TestCase
test_strict_ledger_machine = StrictLedgerMachine.TestCase


# ------------------------------------------------------------------ pause and resume


@MODES
def test_a_paused_branch_leaves_the_live_set_and_resumes_with_what_was_kept(
    strict: bool,
) -> None:
    ledger = held(strict)
    freed = ledger.pause([A0], keep=lambda payload: f"kept {payload}")
    assert freed == {A0: "b0"}
    assert ledger.live("a") == [A1] and ledger.paused == {A0: "kept b0"}
    # Only as a resume: a fresh start of a paused index is a restart.
    with refused(ledger, r"branches \[0\] of 'a' started twice", "a"):
        ledger.start("a", [(BranchSpec(0, 0), "again")])
    ledger.start("a", [(BranchSpec(0, 0, resume=True), "resumed")])
    assert ledger.live("a") == [A0, A1] and not ledger.paused
    assert ledger.branches[A0] == "resumed"


@MODES
def test_only_a_paused_branch_resumes_and_only_a_live_one_pauses(strict: bool) -> None:
    ledger = held(strict)
    with refused(ledger, "resume of branch 2_a, which is not paused", "a"):
        ledger.start("a", [(BranchSpec(2, 2, resume=True), "x")])
    with refused(ledger, "resume of branch 1_a, which is not paused", "a"):  # live
        ledger.check_start("a", [BranchSpec(1, 1, resume=True)])
    with refused(ledger, "pause of branch 2_a, which is not live", "a"):
        ledger.pause([A0, A2], keep=str)
    with refused(ledger, "twice in one call", "a"):
        ledger.pause([A1, A1], keep=str)


def test_releasing_a_prefix_drops_its_paused_branches() -> None:
    ledger = held(strict=True)
    ledger.pause([A0, A1], keep=str)
    assert ledger.release("a") == {}  # nothing live; the kept tokens are dropped
    assert not ledger.paused and not ledger.prefixes
