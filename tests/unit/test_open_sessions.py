"""An open streamed session in a worker's memory (:mod:`scoring_workers.open_sessions`):
each compact turn comes back in its full form, whatever its parent, and what is not a
session is refused."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from infra.schema import InvalidMessage, stream_session
from infra.turns import TurnCompactor
from prm_pipeline.demo.synthetic import make_agent_session, make_session
from scoring_workers.open_sessions import OpenSession


def same(a, b) -> bool:
    ma, mb = a.model_response, b.model_response
    return (
        (a.interaction_id, a.parent_id, list(a.messages), a.output_message_list)
        == (b.interaction_id, b.parent_id, list(b.messages), b.output_message_list)
        and bytes(ma.input_tokens_raw) == bytes(mb.input_tokens_raw)
        and ma.output_tokens_raw == mb.output_tokens_raw
        and (a.shared_messages, a.shared_tokens) == (0, 0)
    )


@pytest.mark.parametrize("seed", range(10))
def test_every_turn_comes_back_full_as_it_arrives(seed: int) -> None:
    rng = np.random.default_rng(seed)
    turns = int(rng.integers(2, 25))
    traj = make_session(
        trajectory_id="t",
        session_id="s",
        group_id="g",
        group_size=1,
        turns=turns,
        output_tokens=(1, 20),
        branch_at=int(rng.integers(0, turns - 1)),
        rng=rng,
    )
    compactor = TurnCompactor()
    session = OpenSession("s")
    originals, _ = stream_session(traj)
    for original in originals:
        sent = compactor.compact(original).interaction
        assert same(session.add(sent), original.interaction)
    for original in originals:  # later, in any order: contexts let go are rebuilt
        assert same(session.full(original.interaction.interaction_id), original.interaction)
    rebuilt = OpenSession.of("s", session.compact.values())
    assert all(same(rebuilt.full(o.interaction.interaction_id), o.interaction) for o in originals)


def test_a_branch_off_an_old_turn_is_rebuilt_along_its_path() -> None:
    traj = make_agent_session(
        trajectory_id="t", session_id="s", group_id="g", turns=12, context_tokens=2000, rng=np.random.default_rng(3)
    )
    originals, _ = stream_session(traj)
    compactor = TurnCompactor()
    session = OpenSession("s")
    for o in originals:
        session.add(compactor.compact(o).interaction)
    old = originals[1].interaction
    mr = old.model_response
    ctx = np.concatenate([mr.input_tokens, mr.output_tokens, np.array([9, 9], np.int32)])
    fork = msgspec.structs.replace(
        originals[2].interaction,
        interaction_id="fork",
        parent_id=old.interaction_id,
        model_response=msgspec.structs.replace(mr, input_tokens_raw=ctx.tobytes()),
    )
    sent = compactor.compact(msgspec.structs.replace(originals[2], interaction=fork)).interaction
    assert sent.shared_tokens == len(mr.input_tokens) + len(mr.output_tokens)
    assert same(session.add(sent), fork)


@pytest.mark.parametrize(
    "case, error",
    [
        ("repeat", "is repeated"),
        ("orphan", "not an earlier turn"),
        ("tokens", "shares 100000 tokens"),
        ("messages", "shares 999 messages"),
    ],
)
def test_what_does_not_continue_the_session_is_refused(case: str, error: str) -> None:
    traj = make_session(trajectory_id="t", session_id="s", group_id="g", group_size=1, turns=3)
    compactor = TurnCompactor()
    turns = [compactor.compact(t).interaction for t in stream_session(traj)[0]]
    session = OpenSession("s")
    session.add(turns[0])
    bad = {
        "repeat": turns[0],
        "orphan": msgspec.structs.replace(turns[1], parent_id="nobody"),
        "tokens": msgspec.structs.replace(turns[1], shared_tokens=100_000),
        "messages": msgspec.structs.replace(turns[1], shared_messages=999),
    }[case]
    with pytest.raises(InvalidMessage, match=error):
        session.add(bad)
    assert len(session) == 1  # nothing of it was kept
    session.add(turns[1])
