"""The helpers of ``sart.errors``: messages name the field and the value, or what to install."""

from __future__ import annotations

import re
import sys

import attrs
import pytest

from sart.errors import ConfigError, MissingDependencyError, int_at_least, needs_extra


@attrs.frozen
class Sized:
    count: int = attrs.field(default=1, validator=int_at_least(1))
    limit: int | None = attrs.field(default=None, validator=int_at_least(16, optional=True))
    stride: int = attrs.field(default=2, validator=int_at_least(2, rule="an even int >= 2"))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("count", 0, "count=0 must be >= 1"),
        ("count", 1.0, "count=1.0 must be >= 1"),
        ("limit", 8, "limit=8 must be None or an int >= 16"),
        ("stride", "2", "stride='2' must be an even int >= 2"),
    ],
)
def test_int_at_least_names_the_field_and_the_value(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        Sized(**{field: value})


def test_int_at_least_accepts_its_bound_and_none_when_optional() -> None:
    assert Sized(count=1, limit=16, stride=2) == Sized(1, 16, 2)
    assert Sized(limit=None).limit is None
    with pytest.raises(ConfigError, match=r"^count=None must be >= 1$"):
        Sized(count=None)  # type: ignore[arg-type]


def test_needs_extra_names_what_needs_the_module_and_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "not_installed_here", None)  # importing it now fails
    with pytest.raises(MissingDependencyError) as info, needs_extra("the X engine", "x", "x-cpu"):
        import not_installed_here  # noqa: F401
    message = str(info.value)
    assert message.startswith(
        "the X engine needs not_installed_here: pip install -e '.[x]' or "
        "pip install -e '.[x-cpu]' in a checkout of sart ("
    )
    assert isinstance(info.value.__cause__, ImportError)


def test_needs_extra_keeps_a_nested_message_and_lets_other_errors_through() -> None:
    inner = MissingDependencyError("the inner guard's message")
    with pytest.raises(MissingDependencyError) as info, needs_extra("outer", "hf"):
        raise inner
    assert info.value is inner
    with pytest.raises(KeyError), needs_extra("outer", "hf"):
        raise KeyError("not an import")
