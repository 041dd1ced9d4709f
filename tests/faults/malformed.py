"""Hypothesis strategies for malformed ``prm.trajectories`` records, and what each must become.

Every :class:`Case` is one or more raw Kafka records (value + headers, published as-is,
bypassing the publisher's validation) under a key of its own, plus its expected end:

* ``Expect.dead(error_class, needle)`` — a dead letter whose ``prm-dl-error-class``
  header is ``error_class`` and whose ``prm-dl-error-message`` contains ``needle``;
* ``Expect.rejected(reason)`` — one verdict for the case's group, ``rejected`` with
  that reason code.

Strategies draw only small choices (sizes, positions, seeds); large arrays are then built
with numpy from a drawn seed, so hypothesis' own buffers stay small and a "huge" example
costs milliseconds. :func:`draw_cases` collects examples deterministically
(``derandomize=True``, no example database) so a run publishes the same batch every time.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from infra.schema import KIND_HEADER, SCHEMA_HEADER
from prm_pipeline.demo.synthetic import make_session

Headers = list[tuple[str, bytes]]
READY_HEADERS: Headers = [(SCHEMA_HEADER, b"1"), (KIND_HEADER, b"ready")]


@dataclass(frozen=True)
class Expect:
    outcome: str  # "dead" | "rejected"
    what: str  # error class or reason code
    needle: str = ""  # for dead letters: a substring of the error message (case-insensitive)

    @staticmethod
    def dead(error_class: str, needle: str) -> Expect:
        return Expect("dead", error_class, needle)

    @staticmethod
    def rejected(reason: str) -> Expect:
        return Expect("rejected", reason)


@dataclass
class Case:
    category: str
    expect: Expect
    records: list[tuple[bytes | None, Headers]]
    key: str = ""  # assigned when the batch is built (unique per case; the group id too)
    note: str = ""
    payload_bytes: int = field(default=0)


# --------------------------------------------------------------------------- building blocks
def _raw(traj: Any) -> dict[str, Any]:
    """A wire struct as the plain msgpack map a producer would send (bytes stay bytes)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(traj))


def _pack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def _session(seed: int, turns: int, out: int, group_size: int = 1, *, suffix: str = "") -> dict[str, Any]:
    """A valid concat-export session (linear chain of ``turns``) as a raw map; ids are
    placeholders replaced by :func:`_with_ids` once the case's key is known."""
    traj = make_session(
        trajectory_id="T" + suffix,
        session_id="S" + suffix,
        group_id="G",
        group_size=group_size,
        turns=turns,
        output_tokens=out,
        prompt_tokens=8,
        rng=np.random.default_rng(seed),
    )
    return _raw(traj)


def _with_ids(raw: dict[str, Any], key: str) -> dict[str, Any]:
    raw = copy.deepcopy(raw)
    raw["group_id"] = key
    raw["trajectory_id"] = f"{key}-{raw['trajectory_id']}"
    raw["session_id"] = f"{key}-{raw['session_id']}"
    return raw


seeds = st.integers(0, 2**32 - 1)
small_sessions = st.tuples(seeds, st.integers(1, 3), st.integers(1, 12))  # (seed, turns, output tokens)


class Template:
    """A case whose records need the case key: ``build(key)`` -> records."""

    def __init__(self, category: str, expect: Expect, build: Any, note: str = "", variant: str = "") -> None:
        self.category, self.expect, self.build, self.note = category, expect, build, note
        self.variant = variant or note  # what makes two examples qualitatively different

    def case(self, key: str) -> Case:
        records = self.build(key)
        return Case(self.category, self.expect, records, key, self.note, sum(len(v or b"") for v, _ in records))


def _ready(mutate: Any) -> Any:
    """build(key) for one ready record made from a mutated raw map."""
    return lambda key: [(_pack(mutate(key)), READY_HEADERS)]


# --------------------------------------------------------------------------- strategies
@st.composite
def truncated(draw: st.DrawFn) -> Template:
    seed, turns, out = draw(small_sessions)
    fraction = draw(st.floats(0.0, 1.0, exclude_max=True))

    def build(key: str) -> list[tuple[bytes | None, Headers]]:
        value = _pack(_with_ids(_session(seed, turns, out), key))
        return [(value[: int(len(value) * fraction)], READY_HEADERS)]

    return Template(
        "truncated msgpack",
        Expect.dead("InvalidMessage", "truncated"),
        build,
        f"cut at {fraction:.2f}",
        variant="empty" if fraction == 0 else f"{turns} turns, cut in {'first' if fraction < 0.5 else 'second'} half",
    )


_WRONG = {  # field -> values of a wrong type for it
    "trajectory_id": st.one_of(st.integers(), st.none(), st.lists(st.integers(), max_size=3)),
    "group_id": st.one_of(st.integers(), st.booleans(), st.binary(max_size=8)),
    "group_size": st.one_of(
        st.text(max_size=5),
        st.floats(allow_nan=False).filter(lambda f: f != int(f) if math.isfinite(f) else True),
        st.none(),
        st.lists(st.integers(), max_size=2),
    ),
    "outcome_reward": st.one_of(st.text(max_size=5), st.none(), st.lists(st.floats(), max_size=2)),
    "interactions": st.one_of(
        st.text(max_size=5), st.integers(), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
    ),
    "is_eval": st.one_of(st.integers(), st.text(max_size=3)),
    "policy_version": st.one_of(
        st.text(max_size=3), st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: f != int(f))
    ),
    "kind": st.one_of(st.sampled_from(["readyy", "verdict", "discard_group", ""]), st.integers()),
}
_WRONG_NESTED = {  # path inside interactions[i] -> wrong values
    ("interaction_id",): st.one_of(st.integers(), st.none()),
    ("messages",): st.one_of(st.text(max_size=5), st.integers()),
    ("model_response", "output_tokens"): st.one_of(st.text(max_size=5), st.lists(st.integers(0, 9), max_size=4)),
    ("model_response", "input_tokens"): st.one_of(st.integers(), st.none()),
    ("model_response",): st.one_of(st.text(max_size=5), st.integers(), st.lists(st.integers(), max_size=2)),
}


@st.composite
def wrong_types(draw: st.DrawFn) -> Template:
    seed, turns, out = draw(small_sessions)
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(_WRONG)))
        bad = draw(_WRONG[name])
        path: tuple[Any, ...] = (name,)
    else:
        sub = draw(st.sampled_from(sorted(_WRONG_NESTED)))
        bad = draw(_WRONG_NESTED[sub])
        path = ("interactions", draw(st.integers(0, turns - 1)), *sub)

    def mutate(key: str) -> dict[str, Any]:
        raw = _with_ids(_session(seed, turns, out), key)
        node = raw
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = bad
        return raw

    needle = "invalid value" if path == ("kind",) and isinstance(bad, str) else "expected"
    return Template(
        "wrong types",
        Expect.dead("InvalidMessage", needle),
        _ready(mutate),
        f"{'.'.join(map(str, path))} = {bad!r}"[:80],
        variant=f"{'.'.join(str(p) for p in path if not isinstance(p, int))}: {type(bad).__name__}",
    )


@st.composite
def huge_arrays(draw: st.DrawFn) -> Template:
    kind = draw(st.sampled_from(["token list", "long broken chain", "logprob mismatch", "garbage"]))
    seed = draw(seeds)
    rng = np.random.default_rng(seed)
    if kind == "token list":  # a token array sent as a msgpack array of ints instead of packed bytes
        n = draw(st.integers(20_000, 120_000))

        def mutate(key: str) -> dict[str, Any]:
            raw = _with_ids(_session(seed, 1, 4), key)
            raw["interactions"][0]["model_response"]["output_tokens"] = rng.integers(0, 32_000, n).tolist()
            return raw

        return Template(
            "huge arrays",
            Expect.dead("InvalidMessage", "expected `bytes`"),
            _ready(mutate),
            f"{n} token ids as an array",
            variant=kind,
        )
    if kind == "long broken chain":  # thousands of turns, one of them duplicated or dangling
        n = draw(st.integers(500, 3_000))
        flaw = draw(st.sampled_from(["duplicate", "dangling"]))

        def mutate(key: str) -> dict[str, Any]:
            raw = _with_ids(_session(seed, 1, 1), key)
            turn = raw["interactions"][0]
            chain = []
            for i in range(n):
                t = copy.deepcopy(turn)
                t["interaction_id"] = f"t{i}"
                t["parent_id"] = f"t{i - 1}" if i else None
                chain.append(t)
            j = int(rng.integers(1, n))
            if flaw == "duplicate":
                chain[j]["interaction_id"] = chain[j - 1]["interaction_id"]
            else:
                chain[j]["parent_id"] = "nowhere"
            raw["interactions"] = chain
            return raw

        needle = "duplicate interaction_id" if flaw == "duplicate" else "unknown parent_id"
        return Template(
            "huge arrays",
            Expect.dead("InvalidMessage", needle),
            _ready(mutate),
            f"{n} turns, {flaw}",
            variant=f"{kind}: {flaw}",
        )
    if kind == "logprob mismatch":
        n = draw(st.integers(10_000, 60_000))

        def mutate(key: str) -> dict[str, Any]:
            raw = _with_ids(_session(seed, 1, 4), key)
            mr = raw["interactions"][0]["model_response"]
            mr["output_tokens"] = rng.integers(0, 32_000, n, dtype="<i4").tobytes()
            mr["output_logprobs"] = (-rng.random(n - 1, dtype=np.float32)).astype("<f4").tobytes()
            return raw

        return Template(
            "huge arrays",
            Expect.dead("InvalidMessage", "output_logprobs"),
            _ready(mutate),
            f"{n} tokens, {n - 1} logprobs",
            variant=kind,
        )
    size = draw(st.integers(100_000, 400_000))  # bigger than the dead-letter cap: stored truncated
    return Template(
        "huge arrays",
        Expect.dead("InvalidMessage", ""),
        lambda key: [(rng.bytes(size), READY_HEADERS)],
        f"{size} random bytes",
        variant=kind,
    )


@st.composite
def non_finite(draw: st.DrawFn) -> Template:
    seed, turns, out = draw(small_sessions)
    value = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    where = draw(st.sampled_from(["outcome_reward", "interaction reward"]))
    i = draw(st.integers(0, turns - 1))

    def mutate(key: str) -> dict[str, Any]:
        raw = _with_ids(_session(seed, turns, out), key)
        if where == "outcome_reward":
            raw["outcome_reward"] = value
        else:
            raw["interactions"][i]["reward"] = value
        return raw

    return Template(
        "NaN/inf rewards", Expect.dead("InvalidMessage", "must be finite"), _ready(mutate), f"{where} = {value}"
    )


@st.composite
def cyclic(draw: st.DrawFn) -> Template:
    seed, turns, out = draw(small_sessions.filter(lambda t: t[1] >= 2))
    shape = draw(st.sampled_from(["full cycle", "self parent", "cycle beside a root"]))

    def mutate(key: str) -> dict[str, Any]:
        raw = _with_ids(_session(seed, turns, out), key)
        its = raw["interactions"]
        if shape == "full cycle":
            its[0]["parent_id"] = its[-1]["interaction_id"]
        elif shape == "self parent":
            its[-1]["parent_id"] = its[-1]["interaction_id"]
        else:  # t0 stays a root; the last two turns point at each other
            its[-1]["parent_id"] = its[-2]["interaction_id"] if len(its) > 2 else its[-1]["interaction_id"]
            its[-2 if len(its) > 2 else -1]["parent_id"] = its[-1]["interaction_id"]
        return raw

    return Template("cyclic parent links", Expect.dead("InvalidMessage", "cycle"), _ready(mutate), shape)


@st.composite
def duplicate_ids(draw: st.DrawFn) -> Template:
    seed, turns, out = draw(small_sessions.filter(lambda t: t[1] >= 2))
    i, j = draw(st.lists(st.integers(0, turns - 1), min_size=2, max_size=2, unique=True))

    def mutate(key: str) -> dict[str, Any]:
        raw = _with_ids(_session(seed, turns, out), key)
        raw["interactions"][j]["interaction_id"] = raw["interactions"][i]["interaction_id"]
        return raw

    return Template(
        "duplicate interaction ids",
        Expect.dead("InvalidMessage", "duplicate interaction_id"),
        _ready(mutate),
        f"turn {j} reuses turn {i}'s id of {turns}",
        variant="child reuses an ancestor's id" if j > i else "ancestor reuses a descendant's id",
    )


@st.composite
def zero_output(draw: st.DrawFn) -> Template:
    """The last turn (a leaf, so the concat rule still holds) generated no tokens: the
    schema allows it, the PRM runner refuses to score it (``output_len > 0``)."""
    seed, turns, out = draw(small_sessions)
    peers = draw(st.integers(0, 2))  # valid members of the same group

    def build(key: str) -> list[tuple[bytes | None, Headers]]:
        size = 1 + peers
        bad = _with_ids(_session(seed, turns, out, size, suffix="0"), key)
        leaf = bad["interactions"][-1]["model_response"]
        leaf["output_tokens"] = b""
        leaf["output_logprobs"] = b""
        members = [bad] + [_with_ids(_session(seed + k, turns, out, size, suffix=str(k)), key) for k in range(1, size)]
        return [(_pack(m), READY_HEADERS) for m in members]

    return Template("output_len 0", Expect.rejected("invalid_reward"), build, f"{peers} valid peers")


@st.composite
def size_mismatch(draw: st.DrawFn) -> Template:
    """Members of one group disagree on ``group_size``. Every claimed size is at least the
    number of members, so no member can complete the group before the disagreement shows."""
    k = draw(st.integers(2, 4))
    sizes = draw(st.lists(st.integers(k, k + 3), min_size=k, max_size=k).filter(lambda s: len(set(s)) > 1))
    seed = draw(seeds)

    def build(key: str) -> list[tuple[bytes | None, Headers]]:
        return [
            (_pack(_with_ids(_session(seed + i, 1, 4, size, suffix=str(i)), key)), READY_HEADERS)
            for i, size in enumerate(sizes)
        ]

    return Template(
        "mismatched group sizes",
        Expect.rejected("group_size_mismatch"),
        build,
        f"sizes {sizes}",
        variant=f"{k} members",
    )


@st.composite
def bad_headers(draw: st.DrawFn) -> Template:
    seed = draw(seeds)
    variant = draw(
        st.sampled_from(
            [
                "no version",
                "future version",
                "garbled version",
                "no kind",
                "verdict kind",
                "discard header on a ready payload",
                "tombstone",
            ]
        )
    )
    headers: Headers = {
        "no version": [(KIND_HEADER, b"ready")],
        "future version": [(SCHEMA_HEADER, b"99"), (KIND_HEADER, b"ready")],
        "garbled version": [(SCHEMA_HEADER, b"\xff\xfe"), (KIND_HEADER, b"ready")],
        "no kind": [(SCHEMA_HEADER, b"1")],
        "verdict kind": [(SCHEMA_HEADER, b"1"), (KIND_HEADER, b"verdict")],
        "discard header on a ready payload": [(SCHEMA_HEADER, b"1"), (KIND_HEADER, b"discard")],
        "tombstone": READY_HEADERS,
    }[variant]
    expect = {
        "no version": Expect.dead("UnknownSchemaVersion", "missing"),
        "future version": Expect.dead("UnknownSchemaVersion", "not supported"),
        "garbled version": Expect.dead("UnknownSchemaVersion", "not supported"),
        "no kind": Expect.dead("UnknownMessageKind", "none"),
        "verdict kind": Expect.dead("UnknownMessageKind", "verdict"),
        "discard header on a ready payload": Expect.dead("InvalidMessage", "header says"),
        "tombstone": Expect.dead("InvalidMessage", "tombstone"),
    }[variant]

    def build(key: str) -> list[tuple[bytes | None, Headers]]:
        value = None if variant == "tombstone" else _pack(_with_ids(_session(seed, 1, 4), key))
        return [(value, headers)]

    return Template("bad headers", expect, build, variant)


@st.composite
def broken_rules(draw: st.DrawFn) -> Template:
    """Well-typed values that break a schema rule, or a tree that is not concat export."""
    seed, turns, out = draw(small_sessions)
    rule = draw(
        st.sampled_from(
            [
                "group_size 0",
                "negative group_size",
                "empty trajectory_id",
                "no interactions",
                "odd token bytes",
                "not concat export",
                "no model_response",
            ]
        )
    )
    draw_size = draw(st.integers(1, 5))

    def mutate(key: str) -> dict[str, Any]:
        raw = _with_ids(_session(seed, max(turns, 2), out), key)
        its = raw["interactions"]
        if rule == "group_size 0":
            raw["group_size"] = 0
        elif rule == "negative group_size":
            raw["group_size"] = -draw_size
        elif rule == "empty trajectory_id":
            raw["trajectory_id"] = ""
        elif rule == "no interactions":
            raw["interactions"] = []
        elif rule == "odd token bytes":
            its[0]["model_response"]["input_tokens"] += b"\x01"
        elif rule == "not concat export":
            mr = its[-1]["model_response"]
            ids = np.frombuffer(mr["input_tokens"], dtype="<i4")  # reversed ids (not bytes: ids stay >= 0)
            mr["input_tokens"] = ids[::-1].tobytes()  # no longer starts with the parent's
        else:
            del its[-1]["model_response"]
        return raw

    expect = {
        "group_size 0": Expect.dead("InvalidMessage", "group_size must be >= 1"),
        "negative group_size": Expect.dead("InvalidMessage", "group_size must be >= 1"),
        "empty trajectory_id": Expect.dead("InvalidMessage", "length >= 1"),
        "no interactions": Expect.dead("InvalidMessage", "must not be empty"),
        "odd token bytes": Expect.dead("InvalidMessage", "multiple of 4"),
        "not concat export": Expect.rejected("not_concat_export"),
        "no model_response": Expect.rejected("not_concat_export"),
    }[rule]
    return Template("broken rules", expect, _ready(mutate), rule)


@st.composite
def dangling(draw: st.DrawFn) -> Template:
    seed, turns, out = draw(small_sessions)
    i = draw(st.integers(0, turns - 1))
    target = draw(st.sampled_from(["nowhere", "", "t999"]))

    def mutate(key: str) -> dict[str, Any]:
        raw = _with_ids(_session(seed, turns, out), key)
        raw["interactions"][i]["parent_id"] = target
        return raw

    return Template(
        "dangling parents",
        Expect.dead("InvalidMessage", "parent_id"),
        _ready(mutate),
        f"turn {i} of {turns} -> {target!r}",
        variant=f"{'root' if i == 0 else 'inner'} -> {target!r}",
    )


@st.composite
def mismatched_lengths(draw: st.DrawFn) -> Template:
    """Small log-prob arrays one value off (the huge variant is under "huge arrays")."""
    seed, turns, out = draw(small_sessions)
    i = draw(st.integers(0, turns - 1))
    delta = draw(st.sampled_from([-1, 1, -4]))

    def mutate(key: str) -> dict[str, Any]:
        raw = _with_ids(_session(seed, turns, out), key)
        mr = raw["interactions"][i]["model_response"]
        n = max(0, len(mr["output_tokens"]) // 4 + delta)
        mr["output_logprobs"] = np.zeros(n, dtype="<f4").tobytes() + (b"\x00\x00" if delta == -4 else b"")
        return raw

    return Template(
        "mismatched lengths",
        Expect.dead("InvalidMessage", "output_logprobs"),
        _ready(mutate),
        f"turn {i}: {delta:+d} log-probs",
        variant=f"{delta:+d}",
    )


@st.composite
def absurd_group_size(draw: st.DrawFn) -> Template:
    """A group size no group can reach: the member parks and the group is rejected at its deadline."""
    seed = draw(seeds)
    size = draw(st.sampled_from([10**6, 10**9, 2**31, 2**63 - 1]))

    def build(key: str) -> list[tuple[bytes | None, Headers]]:
        raw = _with_ids(_session(seed, 1, 4), key)
        raw["group_size"] = size
        return [(_pack(raw), READY_HEADERS)]

    return Template(
        "absurd group sizes", Expect.rejected("missing_sessions"), build, f"group_size {size}", variant=str(size)
    )


_PLACEHOLDER = "\u2603NOT-UTF8\u2603"  # replaced by invalid UTF-8 bytes of the same length


@st.composite
def non_utf8(draw: st.DrawFn) -> Template:
    seed, turns, out = draw(small_sessions)
    where = draw(st.sampled_from(["session_id", "message content", "stop_reason", "interaction_id"]))
    garbage = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]))

    def build(key: str) -> list[tuple[bytes | None, Headers]]:
        raw = _with_ids(_session(seed, turns, out), key)
        it = raw["interactions"][-1]
        if where == "session_id":
            raw["session_id"] = _PLACEHOLDER
        elif where == "message content":
            it["messages"] = [{"role": "user", "content": _PLACEHOLDER}]
        elif where == "stop_reason":
            it["model_response"]["stop_reason"] = _PLACEHOLDER
        else:
            it["interaction_id"] = _PLACEHOLDER
        value = _pack(raw)
        marker = _PLACEHOLDER.encode()
        bad = (garbage * len(marker))[: len(marker)]
        return [(value.replace(marker, bad), READY_HEADERS)]

    return Template(
        "non-UTF-8 text", Expect.dead("InvalidMessage", "utf-8"), build, f"{where}: {garbage!r}", variant=where
    )


CATEGORIES: dict[str, tuple[Any, int]] = {  # strategy, examples to draw
    "truncated msgpack": (truncated(), 6),
    "wrong types": (wrong_types(), 12),
    "huge arrays": (huge_arrays(), 6),
    "NaN/inf rewards": (non_finite(), 6),
    "cyclic parent links": (cyclic(), 5),
    "duplicate interaction ids": (duplicate_ids(), 4),
    "output_len 0": (zero_output(), 4),
    "mismatched group sizes": (size_mismatch(), 4),
    "bad headers": (bad_headers(), 8),
    "broken rules": (broken_rules(), 8),
    "dangling parents": (dangling(), 3),
    "mismatched lengths": (mismatched_lengths(), 3),
    "non-UTF-8 text": (non_utf8(), 4),
}
# Cases that end only at their group deadline: left out of the default batch (the fuzz
# test runs with a long deadline); ``bench faults`` adds them with a short one.
SLOW_CATEGORIES: dict[str, tuple[Any, int]] = {
    "absurd group sizes": (absurd_group_size(), 4),
}


def draw_examples(strategy: Any, n: int) -> list[Template]:
    """``n`` examples, the same ones on every run, as varied as the strategy allows: out
    of ``4 * n`` generated, every distinct ``variant`` first, then the rest in order."""
    out: list[Template] = []

    @settings(
        max_examples=4 * n,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: Any) -> None:
        out.append(example)

    collect()
    firsts: dict[str, Template] = {}
    for t in out:
        firsts.setdefault(t.variant, t)
    rest = [t for t in out if firsts[t.variant] is not t]
    return (list(firsts.values()) + rest)[:n]


def draw_cases(prefix: str, counts: dict[str, int] | None = None, *, distinct: int = 100) -> list[Case]:
    """The malformed batch; case keys are ``{prefix}-{index}`` (also their group ids).

    ``counts`` (category -> cases, from :data:`CATEGORIES` and :data:`SLOW_CATEGORIES`)
    defaults to :data:`CATEGORIES`' own numbers. At most ``distinct`` examples are drawn
    per category; larger counts cycle through them (each case is still built afresh with
    its own key and ids).
    """
    strategies = {**CATEGORIES, **SLOW_CATEGORIES}
    counts = counts if counts is not None else {name: n for name, (_, n) in CATEGORIES.items()}
    templates: list[Template] = []
    for name, n in counts.items():
        drawn = draw_examples(strategies[name][0], min(n, distinct))
        templates += [drawn[i % len(drawn)] for i in range(n)]
    width = len(str(max(1, len(templates) - 1)))
    return [t.case(f"{prefix}-{i:0{max(3, width)}d}") for i, t in enumerate(templates)]
