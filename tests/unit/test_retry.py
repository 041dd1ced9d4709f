"""The one retry policy (infra.retry): delays, jitter, which errors are retried, the bound, the callback."""

from __future__ import annotations

import dataclasses
import random

import pytest

from infra.retry import RetryPolicy, backoff_delay


class Transient(Exception):
    pass


class Permanent(Exception):
    pass


def transient(exc: BaseException) -> bool:
    return isinstance(exc, Transient)


class Flaky:
    """Fails with each of ``errors`` in turn, then answers ``"ok"``."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors, self.calls = list(errors), 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def test_delays_grow_and_cap() -> None:
    policy = RetryPolicy(retryable=transient, base_s=0.2, cap_s=1.0, jitter=False)
    assert [policy.delay(n) for n in range(1, 6)] == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0])
    assert policy.delay(10_000) == 1.0  # no overflow however long the outage
    assert policy.delay(3) == backoff_delay(3, base_s=0.2, cap_s=1.0, jitter=False)


def test_base_is_the_first_pause() -> None:
    """One convention: a caller states the first pause it wants (no halving to fit a formula)."""
    assert backoff_delay(1, base_s=0.05, cap_s=5.0, jitter=False) == 0.05
    assert backoff_delay(2, base_s=0.05, cap_s=5.0, jitter=False) == 0.1
    assert RetryPolicy(retryable=transient, base_s=0.0, cap_s=1.0).delay(7) == 0.0  # retry at once


def test_retry_after_is_a_floor_capped_at_the_cap() -> None:
    policy = RetryPolicy(retryable=transient, base_s=0.1, cap_s=2.0, jitter=False)
    assert policy.delay(1, retry_after=1.5) == 1.5  # the server asked for longer than the backoff
    assert policy.delay(1, retry_after=0.01) == 0.1  # shorter: the backoff stands
    assert policy.delay(1, retry_after=60.0) == 2.0  # never past cap_s


def test_jitter_draws_from_the_given_random_source() -> None:
    policy = RetryPolicy(retryable=transient, base_s=0.1, cap_s=1.0)
    assert policy.delay(2, rng=random.Random(7)) == policy.delay(2, rng=random.Random(7))


def test_jitter_stays_within_half_to_full_delay() -> None:
    policy = RetryPolicy(retryable=transient, base_s=0.2, cap_s=1.0)
    for attempt, full in ((1, 0.2), (2, 0.4), (9, 1.0)):
        draws = [policy.delay(attempt) for _ in range(200)]
        assert all(full / 2 <= d <= full for d in draws)
        assert len(set(draws)) > 1  # jittered, not constant


def test_defaults_match_the_backoff_function() -> None:
    policy = RetryPolicy(retryable=transient, jitter=False)
    assert (policy.base_s, policy.cap_s, policy.max_attempts) == (0.2, 10.0, None)
    assert policy.delay(1) == pytest.approx(0.2) and policy.delay(50) == 10.0


def test_policy_is_frozen_and_checked() -> None:
    policy = RetryPolicy(retryable=transient)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.base_s = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError):
        RetryPolicy(retryable=transient, base_s=-1.0)
    with pytest.raises(ValueError):
        RetryPolicy(retryable=transient, base_s=2.0, cap_s=1.0)
    with pytest.raises(ValueError):
        RetryPolicy(retryable=transient, max_attempts=0)


async def test_transient_errors_are_retried_and_the_callback_sees_each_retry() -> None:
    policy = RetryPolicy(retryable=transient, base_s=0.002, cap_s=0.004, jitter=False)
    op, seen = Flaky(Transient("a"), Transient("b"), Transient("c")), []
    result = await policy.run(op, what="test", on_retry=lambda exc, n, d: seen.append((str(exc), n, d)))
    assert result == "ok" and op.calls == 4
    assert seen == [("a", 1, pytest.approx(0.002)), ("b", 2, pytest.approx(0.004)), ("c", 3, pytest.approx(0.004))]


async def test_permanent_errors_are_raised_at_once() -> None:
    policy = RetryPolicy(retryable=transient, base_s=0.001, cap_s=0.004)
    op, seen = Flaky(Permanent("no")), []
    with pytest.raises(Permanent):
        await policy.run(op, on_retry=lambda *a: seen.append(a))
    assert op.calls == 1 and seen == []


async def test_a_permanent_error_after_transient_ones_ends_the_retries() -> None:
    policy = RetryPolicy(retryable=transient, base_s=0.001, cap_s=0.004)
    op, seen = Flaky(Transient("a"), Permanent("no"), Transient("never reached")), []
    with pytest.raises(Permanent):
        await policy.run(op, on_retry=lambda exc, n, d: seen.append(n))
    assert op.calls == 2 and seen == [1]


async def test_max_attempts_is_honoured() -> None:
    policy = RetryPolicy(retryable=transient, base_s=0.001, cap_s=0.004, max_attempts=3)
    op, seen = Flaky(*(Transient(str(i)) for i in range(10))), []
    with pytest.raises(Transient, match="2"):  # the third attempt's error, not retried
        await policy.run(op, on_retry=lambda exc, n, d: seen.append(n))
    assert op.calls == 3 and seen == [1, 2]
    assert not policy.gives_up(2) and policy.gives_up(3)
    assert not RetryPolicy(retryable=transient).gives_up(10**6)  # unbounded


async def test_without_a_callback_each_retry_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    policy = RetryPolicy(retryable=transient, base_s=0.001, cap_s=0.004)
    with caplog.at_level("WARNING", logger="infra.retry"):
        assert await policy.run(Flaky(Transient("a"), Transient("b")), what="reading things") == "ok"
    retries = [r.getMessage() for r in caplog.records if r.name == "infra.retry"]
    assert len(retries) == 2 and all("Transient during reading things" in m for m in retries)
    assert "(attempt 1: a)" in retries[0] and "(attempt 2: b)" in retries[1]  # the error's own message too
