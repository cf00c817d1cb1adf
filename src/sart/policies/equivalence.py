"""When two answers are one answer: the equivalence votes group answers by.

``MajorityVote`` and ``WeightedVote`` count answers; which answers count
together is an ``Equivalence``. The default, ``ExactMatch``, groups answers
by their string, as the selectors always have. ``sart.eval.MathVerifyEquivalence``
groups answers by mathematical meaning, so that ``\\frac12``, ``\\dfrac{1}{2}``
and ``0.5`` vote together.

An equivalence has two hooks with defaults, in the manner of the other
policy parts:

- ``key(answer)``: a canonical form; answers with equal keys are the same
  answer and are grouped without further calls. Default: the answer itself.
- ``same(a, b)``: called on answers whose keys differ, ``a`` being the
  representative of a group already formed (the first answer that formed
  it, in completion order) and ``b`` the answer being placed. Default: never.

``group_answers`` places each answer, in completion order, into the first
group whose representative it is ``same`` as, else starts a new group. The
grouping is therefore deterministic whenever ``key`` and ``same`` are pure
functions, whatever the ties, and ``same`` is called at most once per
(group, distinct key) pair: ``O(k * g)`` calls for ``k`` distinct keys
forming ``g`` groups. An equivalence that overrides only ``key`` costs one
dict lookup per answer, as exact match does.

Pure: no I/O. An equivalence that needs a library (math-verify) lives
outside the core and imports it when first called.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import attrs

from sart.errors import ConfigError
from sart.views import BranchView, completion_order


class Equivalence:
    """Decides which answers are the same answer, for votes (hooks: ``key``, ``same``).

    Both hooks must be pure and deterministic: the same answers always give
    the same groups, so selection stays reproducible.
    """

    def key(self, answer: str) -> Hashable:
        """A canonical form: answers with equal keys are the same answer."""
        return answer

    def same(self, a: str, b: str) -> bool:
        """Whether ``b`` is the same answer as ``a`` (a group's representative),
        their keys differing. Called only if overridden."""
        return False

    @property
    def compares(self) -> bool:
        """Whether ``same`` is overridden (answers with different keys may still group)."""
        return type(self).same is not Equivalence.same


@attrs.frozen
class ExactMatch(Equivalence):
    """Answers are the same when their strings are equal (the default)."""


def check_equivalence(_inst: object, _attr: attrs.Attribute, value: object) -> None:
    """attrs validator: ``value`` is an ``Equivalence``."""
    if not isinstance(value, Equivalence):
        raise ConfigError(f"equivalence={value!r} must be an Equivalence")


def group_answers(
    candidates: Sequence[BranchView], answers: Sequence[str], equivalence: Equivalence
) -> list[list[BranchView]]:
    """Branches grouped by answer under ``equivalence``, groups in order of their
    first branch's completion, each group in completion order.

    Empty answers (nothing extractable) form their own group, are never
    passed to the equivalence, and vote only if no branch has an answer.
    """
    pairs = sorted(zip(candidates, answers), key=lambda p: completion_order(p[0]))
    groups: list[list[BranchView]] = []
    representatives: list[str] = []
    group_of_key: dict[Hashable, int] = {}
    empty: list[BranchView] = []
    compares = equivalence.compares
    for branch, answer in pairs:
        if answer == "":
            empty.append(branch)
            continue
        key = equivalence.key(answer)
        index = group_of_key.get(key)
        if index is None and compares:
            index = next(
                (i for i, rep in enumerate(representatives) if equivalence.same(rep, answer)),
                None,
            )
        if index is None:
            index = len(groups)
            groups.append([])
            representatives.append(answer)
        group_of_key.setdefault(key, index)
        groups[index].append(branch)
    if not groups:
        return [empty] if empty else []
    return groups
