"""The per-request part of Algorithm 1: what one request's check decides.

Read next to the paper (section 4, Algorithm 1, function ``Decode``): after a
decode chunk each involved request is *checked*:

1. ``count_completions``: the first completed branch moves the request from the
   exploration phase to the exploitation phase, with the threshold and pruning
   budget the prune rule's ``enter_exploit`` gives (lines 32-35), and
   completions are counted (lines 36-39);
2. ``prune_due`` / ``choose_prunes``: every ``T`` steps, while the pruning budget
   lasts, the prune rule picks low-reward running branches (lines 40-45: at most
   ``beta`` in the first phase); ``prune_forks`` lets a rule (Rebase) start
   children of survivors in the slots the prunes freed;
3. ``should_finish``: the request ends when no branch is left or its stop rule
   says so (``M`` completed; lines 46-48), and ``choose_answer`` picks the
   response by the selection rule (the highest PRM reward, section 5.1);
4. beyond the paper, ``rebranch_forks``: a request that goes on may re-spend its
   free seats (``n`` less its live branches) on forks of its best live branches,
   as its re-branching rule asks (``sart.policies.rebranch``).

These functions change only the request's own records (``RequestState``); the
scheduler (``core``) turns what they return into commands and frees the batch
slots. Every policy hook runs through ``hooks``, so a broken rule fails its
request alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from sart.commands import Refusal
from sart.messages import TokenLogprobs
from sart.results import RequestResult
from sart.scheduler.hooks import PolicyFailure, call, checked_limits, choose_running, whole
from sart.state import BranchState, RequestState
from sart.types import BranchId, BranchStatus, Phase, RequestStatus
from sart.views import RequestView


def count_completions(req: RequestState, ended: Sequence[BranchState]) -> None:
    """Phase change at the first completion, and the completion count."""
    completed = [b for b in ended if b.status.is_completed]
    if completed and req.phase is Phase.EXPLORE:
        req.phase = Phase.EXPLOIT
        first = min(completed, key=lambda b: (b.end_step, b.index))
        limits = call(req.policy.prune.enter_exploit, req.limits, first.view(), req.n)
        req.limits = checked_limits(limits, "enter_exploit")
    req.num_completed += len(completed)


def may_prune(req: RequestState, ended: Sequence[BranchState]) -> bool:
    """Whether a check could prune: the budget is not spent, or the phase is
    about to change (a first completion), which may raise it."""
    if req.phase is Phase.EXPLORE and any(b.status.is_completed for b in ended):
        return True
    return min(req.limits.max_num_pruned, len(req.branches) - 1) > req.num_pruned


def prune_due(req: RequestState, due: bool, ended: Sequence[BranchState]) -> bool:
    """Whether this check prunes: its interval is due, its rule prunes, a branch
    runs and the budget allows."""
    return due and req.policy.prune.active and req.running > 0 and may_prune(req, ended)


def choose_prunes(req: RequestState) -> tuple[list[BranchState], RequestView]:
    """The running branches the prune rule picks, cut to the pruning budget (never
    all ``n``), and the view it picked them from."""
    view = req.view()
    victims = choose_running(req, view, req.policy.prune, "prune")
    # Every choice is checked (above), not only those within the budget, so a bad
    # rule fails the same way whatever the budget.
    budget = min(req.limits.max_num_pruned, len(req.branches) - 1) - req.num_pruned
    del victims[max(budget, 0) :]
    return victims, view


def fork_children(
    req: RequestState, wanted: object, room: int, rule: str, room_is: str
) -> list[BranchState]:
    """The children ``wanted`` (``{running branch index: children}``, from ``rule``) asks
    for, checked and added to ``req``: at most ``room`` of them, each of a running branch
    (never of a pruned or finished one), each starting where its parent is."""
    if not isinstance(wanted, Mapping):
        raise PolicyFailure(f"{rule} returned {wanted!r}, not a mapping of index to children")
    items = call(lambda: list(wanted.items()), name=f"the {rule}'s mapping")
    asked: dict[int, object] = {}
    for key, count in items:  # every key checked before they are sorted: 0 < "a" raises
        index = whole(key)
        if index is None or not 0 <= index < len(req.branches) or index in asked:
            raise PolicyFailure(f"{rule} chose {key!r}, not a branch index")
        asked[index] = count
    parents: list[tuple[BranchState, int]] = []
    for index, asked_for in sorted(asked.items()):
        parent = req.branches[index]
        if parent.status is not BranchStatus.RUNNING:
            raise PolicyFailure(f"{rule} chose branch {index}, which is not running")
        count = whole(asked_for)
        if count is None or count < 0:
            raise PolicyFailure(f"{rule} asked for {asked_for!r} children of branch {index}")
        parents.append((parent, count))
    total = sum(count for _, count in parents)
    if total > room:
        raise PolicyFailure(f"{rule} asked for {total} new branches; {room_is}")
    children: list[BranchState] = []
    for parent, count in parents:
        for _ in range(count):
            at = len(req.branches)
            child = BranchState.forked(BranchId(req.id, at), req.request.seed + at, parent)
            req.branches.append(child)
            children.append(child)
    return children


def prune_forks(req: RequestState, view: RequestView, freed: int) -> list[BranchState]:
    """The children a forking prune rule (Rebase) asks for, in the ``freed`` slots its
    prunes just freed (so a fork never takes a batch slot from another request)."""
    rule = req.policy.prune
    name = f"{type(rule).__name__}.fork"
    wanted = call(rule.fork, view, name=name)  # a mapping, checked in ``fork_children``
    return fork_children(req, wanted, freed, "fork rule", f"pruning freed {freed} slots")


def rebranch_room(req: RequestState, free_slots: int) -> int:
    """Forks ``req`` may start now: its free seats (``n`` less its live branches), and
    never more than the batch's free slots (a fork never waits for a slot)."""
    return max(0, min(req.n - req.live, free_slots))


def rebranch_forks(req: RequestState, free_slots: int) -> list[BranchState]:
    """The children the request's re-branching rule asks for, within ``rebranch_room``."""
    room = rebranch_room(req, free_slots)
    if room == 0 or not req.running:
        return []
    rule = req.policy.rebranch
    name = f"{type(rule).__name__}.fork"
    wanted = call(rule.fork, req.view(), room, name=name)
    return fork_children(req, wanted, room, "rebranch rule", f"{room} may start now")


def should_finish(req: RequestState, view: RequestView | None) -> bool:
    """Whether ``req`` ends now: no branch left to run, or its stop rule says so
    (``view``: the request after this check's prunes, if any)."""
    if any(b.status.is_completed for b in req.newly_ended):
        # Overlapped: a branch completed after this check's snapshot; its final
        # reward comes with the next check, and selection waits for it.
        return False
    if not req.running and not req.has_waiting():
        return True
    # Stop rules are consulted only once a branch has completed, so a finished
    # request always has an answer.
    if not req.num_completed:
        return False
    rule = req.policy.stop
    view = view or req.view()
    if rule.needs_answers:
        view = with_answers(req, view)
    return bool(call(rule.should_stop, view))


def answer(req: RequestState, branch: BranchState) -> str:
    """A completed branch's answer by the policy's ``extract``, extracted once."""
    if branch.answer is None:
        value = call(req.policy.extract, branch.text)
        if not isinstance(value, str):
            raise PolicyFailure(f"extract returned {value!r}; answers must be str")
        branch.answer = value
    return branch.answer


def with_answers(req: RequestState, view: RequestView) -> RequestView:
    """``view`` with its completed branches' answers (for a stop rule that reads them)."""
    branches = tuple(
        attrs.evolve(b, answer=answer(req, req.branches[b.index])) if b.is_completed else b
        for b in view.branches
    )
    return attrs.evolve(view, branches=branches)


def choose_answer(req: RequestState) -> tuple[BranchState, dict[int, str]]:
    """The chosen completed branch, and every completed branch's extracted answer.

    The selector chooses among the branches that finished (EOS or a stop string) when
    any did: one cut at ``max_tokens`` never wrote its conclusion (a loop, or thinking
    cut short), and whatever ``extract`` makes of its last words is no answer. Only
    when every completed branch was cut does it choose among those."""
    completed = [b for b in req.branches if b.status.is_completed]
    if not completed:
        raise PolicyFailure("no branch completed")
    policy = req.policy
    answer_of = {b.index: answer(req, b) for b in completed}
    candidates = [b for b in completed if b.status is BranchStatus.FINISHED] or completed
    answers = [answer_of[b.index] for b in candidates]
    if len(candidates) == 1:
        chosen = candidates[0]
    else:
        index = call(policy.select.choose, [b.view() for b in candidates], answers)
        matches = [b for b in candidates if b.index == index]
        if not matches:
            raise PolicyFailure(f"selector chose {index!r}, not a completed branch")
        chosen = matches[0]
    return chosen, answer_of


def completed_result(
    req: RequestState, chosen: BranchState, answer_of: dict[int, str], now: float
) -> RequestResult:
    return RequestResult(
        request_id=req.id,
        status=RequestStatus.COMPLETED,
        chosen=chosen.index,
        text=chosen.text,
        answer=answer_of[chosen.index],
        branches=tuple(b.outcome(answer_of.get(b.index)) for b in req.branches),
        timings=req.timings(now),
        policy=req.policy.name,
        prm_items=req.prm_items,
        logprobs=kept_logprobs(req, chosen),
    )


def kept_logprobs(req: RequestState, chosen: BranchState) -> tuple[TokenLogprobs, ...] | None:
    """The chosen branch's log-probabilities, as many most likely tokens each as the
    request asked for (a confidence reward source may have asked the engine for more)."""
    if chosen.logprobs is None:
        return None
    k = req.request.sampling.logprobs or 0
    return tuple(lp.cut(k) for lp in chosen.logprobs)


def unfinished_result(
    req: RequestState,
    status: RequestStatus,
    reason: str,
    now: float,
    refusal: Refusal | None = None,
) -> RequestResult:
    """The result of a request that ends without an answer (failed or cancelled)."""
    return RequestResult(
        request_id=req.id,
        status=status,
        chosen=None,
        text=None,
        answer=None,
        branches=tuple(b.outcome(None) for b in req.branches),
        timings=req.timings(now),
        reason=reason,
        refused=refusal is not None,
        refused_field=refusal.field if refusal is not None else None,
        policy=req.policy.name,
        prm_items=req.prm_items,
    )
