"""The one method registry (``sart.methods``): what every command knows of a method."""

from __future__ import annotations

from pathlib import Path

import pytest

import sart
from sart.methods import Rewards, check_methods, get_method, method_names, register_method
from sart.types import Scoring


def test_built_in_methods_build_the_recipes_they_name() -> None:
    assert get_method("sc").policy(4, 16) == sart.self_consistency(4, interval=16)
    assert get_method("sart").policy(8, 400) == sart.sart(8)
    assert get_method("sart").policy(8, 400, m=2, beta=1) == sart.sart(8, m=2, beta=1)
    # A one-branch method ignores n.
    assert get_method("vanilla").policy(8, 16) == sart.vanilla(interval=16)


BUILT_IN = ("deepconf", "rebase", "sart", "sart-blocking", "sart-conf", "sart-no-prune", "sc",
            "vanilla")  # fmt: skip


def test_each_method_says_where_its_rewards_come_from() -> None:
    # (Other tests, and the tutorials, register methods of their own in this process.)
    assert set(BUILT_IN) <= set(method_names())
    rewards = {name: get_method(name).rewards for name in BUILT_IN}
    assert rewards["vanilla"] is rewards["sc"] is Rewards.NONE
    assert rewards["deepconf"] is rewards["sart-conf"] is Rewards.CONFIDENCE
    assert {n for n, r in rewards.items() if r is Rewards.PRM} == {
        "rebase",
        "sart",
        "sart-blocking",
        "sart-no-prune",
    }
    assert [m for m in BUILT_IN if not get_method(m).needs_prm] == [
        "deepconf",
        "sart-conf",
        "sc",
        "vanilla",
    ]


def test_sart_blocking_is_sart_with_blocking_checks() -> None:
    blocking, plain = get_method("sart-blocking"), get_method("sart")
    assert blocking.policy(8, 400) == plain.policy(8, 400)
    assert blocking.scoring_in(Scoring.OVERLAPPED) is Scoring.BLOCKING
    assert plain.scoring_in(Scoring.OVERLAPPED) is Scoring.OVERLAPPED
    assert (blocking.label, blocking.short_label) == ("SART (blocking checks)", "SART-blocking")


def test_an_option_a_method_does_not_read_is_refused() -> None:
    with pytest.raises(sart.ConfigError, match=r"alpha=0\.3 does not apply to method 'sc'"):
        get_method("sc").policy(4, 16, alpha=0.3)


def test_unknown_names_are_refused_with_the_choices() -> None:
    with pytest.raises(sart.UnknownComponentError, match=r"method='beam' must be one of \["):
        get_method("beam")
    with pytest.raises(sart.ConfigError, match="methods='beam' must be one of"):
        check_methods(["sc", "beam"])
    assert check_methods(["sc", "sart", "sc"]) == ("sc", "sart")


def test_a_registered_method_is_known_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    import sart.methods as registry

    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    method = register_method(
        "wide-sc",
        lambda n, interval: sart.self_consistency(2 * n, interval=interval),
        label="Self-Consistency at 2N",
        rewards="none",
    )
    assert get_method("wide-sc") is method
    assert method.short_label == "Self-Consistency at 2N"  # defaults to the label
    assert method.policy(4, 16).n == 8
    with pytest.raises(sart.ConfigError, match="rewards='votes' must be one of"):
        register_method("bad", lambda n, interval: sart.vanilla(), rewards="votes")
    register_method("not-a-policy", lambda n, interval: "x")
    with pytest.raises(TypeError, match=r"built 'x', not a sart\.Policy"):
        get_method("not-a-policy").policy(2, 16)


@pytest.mark.parametrize("doc", ["docs/reference/api.md", "docs/tutorials/serve.md"])
def test_every_builtin_method_is_documented(doc: str) -> None:
    # The registry is the one list of methods; the API reference and the server's
    # tutorial name each built-in, so a new method cannot land undocumented.
    text = (Path(__file__).resolve().parents[1] / doc).read_text()
    missing = [name for name in method_names() if f"`{name}`" not in text]
    assert not missing, f"{doc} does not name {missing}"
