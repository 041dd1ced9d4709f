"""The adapters' shared core (shaper.integrations.core): settings, the timeout policy, the bridges, the text routes.

The adapters themselves run against their frameworks in tests/ecosystem; here the policy they
share is checked without Kafka (a fake client stands in for RewardClient) and without a framework.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from infra.config import ConfigError, GatewayConfig, PRMAdvantageShapingConfig
from infra.errors import TrainingError
from infra.event_loop import LoopThread
from shaper.integrations import core, openrlhf_reward, slime_rm
from shaper.reward_client import Sample, SampleReward

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = sorted(
    p for p in (ROOT / "shaper" / "integrations").glob("*.py") if p.name not in ("__init__.py", "core.py")
)


def reward(
    status: str = "accepted", values: tuple[float, ...] = (0.5, -0.5), outcome: float = 1.0, group: str = "g"
) -> SampleReward:
    tokens = np.asarray(values, dtype=np.float32)
    reason = f"no verdict for group {group!r} within 1s" if status == "timeout" else ""
    return SampleReward(
        group,
        f"{group}/t",
        status,
        reason,
        outcome,
        tokens,  # type: ignore[arg-type]
        [float(tokens.mean())],
        [(0, len(tokens))],
    )


class FakeClient:
    """``score_group`` answers every group with ``status``; records the groups it was given."""

    def __init__(self, status: str = "accepted") -> None:
        self.status = status
        self.groups: list[tuple[str, int]] = []

    async def score_group(self, samples: list[Sample], *, group_id: str) -> list[SampleReward]:
        self.groups.append((group_id, len(samples)))
        return [reward(self.status, tuple(0.25 for _ in s.response_ids), s.outcome_reward, group_id) for s in samples]


# --------------------------------------------------------------------------- the adapters stay glue
@pytest.mark.parametrize("path", ADAPTERS, ids=lambda p: p.name)
def test_each_adapter_is_at_most_200_lines_of_framework_glue(path: Path) -> None:
    source = path.read_text()
    assert len(source.splitlines()) <= 200, f"{path.name}: move shared policy into shaper/integrations/core.py"
    for pattern in (
        r"class VerdictTimeout\b",
        r"new_event_loop",
        r"WeakKeyDictionary",
        r"run_coroutine_threadsafe",
        r"on_timeout not in",
    ):
        assert not re.search(pattern, source), f"{path.name} reimplements {pattern!r}: use the core's"


def test_one_verdict_timeout_in_the_exception_tree() -> None:
    assert issubclass(core.VerdictTimeout, TrainingError) and issubclass(core.VerdictTimeout, TimeoutError)
    assert openrlhf_reward.VerdictTimeout is core.VerdictTimeout is slime_rm.VerdictTimeout


# --------------------------------------------------------------------------- settings
def test_settings_check_their_values_and_are_frozen() -> None:
    s = core.AdapterSettings()
    assert (s.on_timeout, s.reduction, s.verdict_timeout_s) == ("outcome_only", "mean", None)
    with pytest.raises(ConfigError, match="on_timeout must be one of 'outcome_only', 'reject', 'raise'"):
        core.AdapterSettings(on_timeout="skip")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="reduction must be one of"):
        core.AdapterSettings(reduction="max")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="verdict_timeout_s must be a positive number"):
        core.AdapterSettings(verdict_timeout_s=0.0)
    with pytest.raises(AttributeError):
        s.on_timeout = "raise"  # type: ignore[misc]
    assert msgspec.json.decode(b'{"on_timeout": "reject"}', type=core.AdapterSettings).on_timeout == "reject"


def test_an_adapter_names_the_policies_it_supports_and_old_names_map() -> None:
    with pytest.raises(ConfigError, match=r"prm_on_timeout must be one of 'outcome_only', 'raise', got 'reject'"):
        core.AdapterSettings.checked(on_timeout="reject", supports=("outcome_only", "raise"), key="prm_on_timeout")
    with pytest.warns(DeprecationWarning, match="'record' is deprecated; it means 'outcome_only'"):
        s = core.AdapterSettings.checked(on_timeout="record", supports=("outcome_only", "raise"))
    assert s.on_timeout == "outcome_only"
    assert core.AdapterSettings.checked(verdict_timeout_s=5).verdict_timeout_s == 5.0


def test_gateway_settings_raise_on_a_late_verdict() -> None:
    gw = GatewayConfig(process_reduction="sum", verdict_timeout_s=7.0)
    assert core.AdapterSettings.from_gateway(gw) == core.AdapterSettings(
        on_timeout="raise", reduction="sum", verdict_timeout_s=7.0
    )


def test_scalar_is_outcome_plus_reduced_process_rewards() -> None:
    assert core.AdapterSettings(reduction="sum").scalar(reward()) == 1.0
    assert core.AdapterSettings(reduction="last").scalar(reward()) == 0.5
    assert core.AdapterSettings().scalar(reward("rejected")) == 1.0


# --------------------------------------------------------------------------- the timeout policy
def test_settle_counts_and_applies_the_policy(caplog: pytest.LogCaptureFixture) -> None:
    counts: Counter[str] = Counter()
    assert core.settle([reward(), reward()], core.AdapterSettings(), counts) is False
    assert core.settle([reward("timeout")], core.AdapterSettings(), counts, who="x") is True
    assert "x: no verdict for group 'g' within 1s; the samples keep their outcome" in caplog.text
    assert core.settle([reward("timeout")], core.AdapterSettings(on_timeout="reject"), counts) is True
    assert "the group is rejected" in caplog.text
    with caplog.at_level(logging.INFO):
        assert core.settle([reward("rejected")], core.AdapterSettings(), counts) is False
    assert "group g rejected" in caplog.text
    with pytest.raises(core.VerdictTimeout, match="no verdict for group 'g' within 1s .its trajectories are published"):
        core.settle([reward("timeout")], core.AdapterSettings(on_timeout="raise"), counts)
    assert counts == {"accepted": 2, "timeout": 3, "rejected": 1}


# --------------------------------------------------------------------------- bridges
def test_loop_thread_runs_coroutines_and_refuses_its_own_loop() -> None:
    bridge = LoopThread("prm-test-bridge")
    try:
        assert bridge.run(asyncio.sleep(0, result=3)) == 3

        async def nested() -> None:
            bridge.run(asyncio.sleep(0))

        with pytest.raises(RuntimeError, match="called from its own event loop"):
            bridge.run(nested())
    finally:
        bridge.close()
    assert bridge.loop.is_closed() and not bridge.thread.is_alive()
    bridge.close()  # twice is fine


def test_loop_client_starts_on_first_use_and_a_failed_start_leaves_no_thread() -> None:
    made: list[object] = []

    class Client:
        closed = False

        async def aclose(self) -> None:
            self.closed = True

    async def make() -> Client:
        if not made:
            made.append(None)
            raise ConnectionError("broker down")
        made.append(Client())
        return made[-1]  # type: ignore[return-value]

    bridged = core.LoopClient(make, "prm-test-client")
    with pytest.raises(ConnectionError):
        bridged.run(lambda c: asyncio.sleep(0, result=c))
    assert not [t for t in threading.enumerate() if t.name == "prm-test-client"]
    first = bridged.run(lambda c: asyncio.sleep(0, result=c))
    assert bridged.run(lambda c: asyncio.sleep(0, result=c)) is first
    bridged.close()
    assert first.closed and not [t for t in threading.enumerate() if t.name == "prm-test-client"]
    assert bridged.run(lambda c: asyncio.sleep(0, result=c)) is not first  # a later run starts anew
    bridged.close()


def test_per_loop_values_belong_to_their_loop() -> None:
    per_loop: core.PerLoop[SimpleNamespace] = core.PerLoop()

    class Value(SimpleNamespace):
        async def aclose(self) -> None:
            self.closed = True

    async def use() -> tuple[Value, Value, Value]:
        a = per_loop.get("k", lambda: Value(closed=False))
        again = per_loop.get("k", lambda: Value(closed=False))
        other = per_loop.get("j", lambda: Value(closed=False))
        await per_loop.aclose()
        return a, again, other

    a, again, other = asyncio.run(use())
    b, _, _ = asyncio.run(use())
    assert a is again and a is not other and a is not b and a.closed and other.closed


# --------------------------------------------------------------------------- the text routes
def samples(n: int) -> list[Sample]:
    return [Sample(prompt_ids=[1], response_ids=[2, 3]) for _ in range(n)]


def test_openrlhf_scores_group_per_query_or_per_request() -> None:
    client = FakeClient()
    answer = asyncio.run(core.openrlhf_scores(client, GatewayConfig(), samples(3)))  # type: ignore[arg-type]
    assert answer["rewards"] == [0.25] * 3 and answer["status"] == ["accepted"] * 3
    assert [n for _, n in client.groups] == [1, 1, 1] and all(g.startswith("openrlhf-") for g, _ in client.groups)
    client = FakeClient()
    seen: list[str] = []
    asyncio.run(
        core.openrlhf_scores(
            client,
            GatewayConfig(grouping="per_request"),
            samples(3),  # type: ignore[arg-type]
            prefix="gw",
            observe=lambda r: seen.append(r.status),
        )
    )
    assert [n for _, n in client.groups] == [3] and client.groups[0][0].startswith("gw-") and len(seen) == 3


def test_text_routes_raise_verdict_timeout_naming_the_group() -> None:
    with pytest.raises(core.VerdictTimeout, match="no verdict for group 'slime-"):
        asyncio.run(core.slime_scores(FakeClient("timeout"), GatewayConfig(), samples(1)))  # type: ignore[arg-type]
    (answer,) = asyncio.run(core.slime_scores(FakeClient(), GatewayConfig(), samples(1)))  # type: ignore[arg-type]
    assert answer["token_rewards"] == [0.25, 0.25] and answer["score"] == 0.25 and answer["turn_rewards"] == [0.25]


def test_score_blocks_scores_consecutive_blocks_and_settles() -> None:
    client, counts = FakeClient(), Counter[str]()
    got = asyncio.run(
        core.score_blocks(
            client,
            samples(4),
            ["p", "p", "q", "q"],
            2,  # type: ignore[arg-type]
            core.AdapterSettings(),
            counts,
            prefix="trl",
        )
    )
    assert len(got) == 4 and [n for _, n in client.groups] == [2, 2] and counts == {"accepted": 4}
    with pytest.raises(ValueError, match="prompts differ"):
        core.groups_of(4, 2, ["p", "q", "q", "p"])
    with pytest.raises(ValueError, match="do not split into groups of 2"):
        core.groups_of(3, 2, ["p", "p", "q"])


# --------------------------------------------------------------------------- helpers
def test_shaping_overrides_are_checked() -> None:
    base = PRMAdvantageShapingConfig()
    assert core.shaping_with(base, {"mode": "gvpo"}, "shaping").mode == "gvpo"
    with pytest.raises(ConfigError, match=r"shaping: unknown keys \['mdoe'\]"):
        core.shaping_with(base, {"mdoe": "gvpo"}, "shaping")
    with pytest.raises(ConfigError, match="shaping: .*mode must be one of"):
        core.shaping_with(base, {"mode": "nope"}, "shaping")


def test_option_reads_nested_configs_rows_and_rates() -> None:
    config = {"a": SimpleNamespace(b={"c": 3})}
    assert core.option(config, "a.b.c") == 3 and core.option(config, "a.x.c", 7) == 7
    rows = core.token_rows([reward(values=(1.0, 2.0, 3.0)), reward(values=(4.0,))], 2)
    assert rows.tolist() == [[1.0, 2.0], [4.0, 0.0]]
    assert core.status_rates([reward(), reward("timeout")]) == {"prm/accepted": 0.5, "prm/timeout": 0.5}
    assert asyncio.run(core.resolved(asyncio.sleep(0, result=2))) == 2 and asyncio.run(core.resolved(2)) == 2
