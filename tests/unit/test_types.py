"""The settings boundary: one wording for every msgspec validation error, and the shared bounds."""

from __future__ import annotations

from typing import Annotated

import msgspec
import pytest

from infra.errors import ConfigError, WireError
from infra.types import Finite, Seconds, TokenId, explain, validating


class _Inner(msgspec.Struct, forbid_unknown_fields=True):
    ids: Annotated[list[TokenId], msgspec.Meta(description="a list of token ids")]
    timeout_s: Seconds = 1.0


class _Ruled(msgspec.Struct, frozen=True):
    low: int = 0
    high: int = 1

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError("pair.low must not exceed pair.high")


class _Outer(msgspec.Struct, forbid_unknown_fields=True):
    inner: _Inner
    items: list[_Inner] = []
    maybe: _Inner | None = None
    pair: _Ruled = _Ruled()
    score: Finite = 0.0


def _text(data: object, where: str = "") -> str:
    with pytest.raises(ConfigError) as info, validating(where, root=_Outer):
        msgspec.convert(data, _Outer)
    return str(info.value)


def test_a_bad_value_is_named_by_its_path_with_what_the_field_holds() -> None:
    assert _text({"inner": {"ids": [1, -2]}}) == "inner.ids[1]: Expected `int` >= 0 (a token id: int32, non-negative)"
    assert _text({"inner": {"ids": "12"}}) == "inner.ids: Expected `array`, got `str` (a list of token ids)"
    assert _text({"inner": {"ids": [], "timeout_s": 0}}) == (
        "inner.timeout_s: Expected `float` > 0.0 (a duration in seconds, above zero)"
    )


def test_an_unknown_key_names_the_closest_valid_one_or_all_of_them() -> None:
    assert _text({"inner": {"ids": [], "timeout": 1}}) == "inner: unknown key `timeout`; did you mean `timeout_s`?"
    assert _text({"inner": {"ids": []}, "items": [{"ids": [], "zzz": 1}]}) == (
        "items[0]: unknown key `zzz`; valid keys: ids, timeout_s"
    )
    assert _text({"inner": {"ids": []}, "maybe": {"ids": [], "idz": 1}}) == (  # through ``X | None``
        "maybe: unknown key `idz`; did you mean `ids`?"
    )


def test_a_missing_field_is_named_by_its_full_path() -> None:
    assert _text({"inner": {}}) == "inner.ids: missing required field"
    assert _text({}) == "inner: missing required field"


def test_a_rule_that_names_its_field_is_not_named_twice() -> None:
    assert _text({"inner": {"ids": []}, "pair": {"low": 2}}) == "pair.low must not exceed pair.high"


def test_where_prefixes_the_path() -> None:
    assert _text({"inner": {"ids": ["x"]}}, "prm") == (
        "prm.inner.ids[0]: Expected `int`, got `str` (a token id: int32, non-negative)"
    )
    assert _text([], "prm") == "prm: Expected `object`, got `array`"


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_finite_refuses_infinities_and_nan(value: float) -> None:
    assert "score:" in _text({"inner": {"ids": []}, "score": value})


def test_the_callers_error_class_and_msgspecs_own_text() -> None:
    """``error`` builds the caller's class; the text keeps msgspec's wording beside it (``raw``)."""
    with pytest.raises(WireError, match=r"^inner: missing required field$"), validating(root=_Outer, error=WireError):
        msgspec.json.decode(b"{}", type=_Outer)
    try:
        msgspec.convert({}, _Outer)
    except msgspec.ValidationError as exc:
        assert explain(exc, _Outer).raw == "Object missing required field `inner`"


def test_without_a_root_the_path_and_msgspecs_problem_remain() -> None:
    try:
        msgspec.convert({"inner": {"ids": [], "bad": 1}}, _Outer)
    except msgspec.ValidationError as exc:
        assert explain(exc) == "inner: unknown key `bad`"
