"""What a registry record may set on each built-in scorer (the capability model,
:mod:`scoring_workers.prm.capabilities`), and why the other arguments are operator-only.

Record-settable: arguments that only tune scoring — sampling, votes, budgets, timeouts,
retries, pool routing — each typed and bounded here (durations at least
:data:`MIN_RECORD_SECONDS`, rates at least :data:`MIN_RECORD_RPS`; a record's limits and
breaker settings bound only its own experiment's calls, :mod:`scoring_workers.judge.limits`), and judge URLs, which
the worker
still holds to its judge host allow-list. The bounds here are a record's, tighter than
what the operator's own file may set (the judge's settings structs,
:mod:`scoring_workers.judge.settings`, and the scorers' :class:`~scoring_workers.scorers.
openclaw.JudgingSettings`); the choices (``api``, ``next_state``,
``on_all_votes_failed``) are the same types. Operator-only: every argument that can load
code, read the worker's environment or files, or choose what goes where beyond an
allowed host. docs/security.md prints the table these declarations make (a test keeps
the two equal).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Final, Literal

from msgspec import UNSET, Meta, UnsetType

from scoring_workers.judge.settings import JudgeApi
from scoring_workers.prm.capabilities import RecordSettings
from scoring_workers.scorers.conversation import NextStateRule

__all__ = [
    "JUDGE_OPERATOR_ONLY",
    "MIN_RECORD_RPS",
    "MIN_RECORD_SECONDS",
    "OPD_OPERATOR_ONLY",
    "FailurePolicy",
    "JudgeRecordSettings",
    "LengthBudgetRecordSettings",
    "OPDRecordSettings",
    "OpenClawRecordSettings",
]

FailurePolicy = Literal["reject", "neutral"]
"""What a judge scorer's turn gives when every vote failed (``on_all_votes_failed``)."""

MIN_RECORD_SECONDS: Final = 0.1
"""The shortest duration a record may set: a judge call cannot answer sooner, so anything
shorter (``timeout_s: 1e-300``) is not tuning but a failure of every call."""
MIN_RECORD_RPS: Final = 0.01
"""The lowest rate a record may set (one call per 100 s)."""

_Url = Annotated[str, Meta(min_length=1, max_length=2048)]
_Urls = Annotated[list[_Url], Meta(min_length=1, max_length=64)]
# A record may ask for a judge timeout of at most an hour, tighter than infra.types.Seconds:
# a record is untrusted, and one slow experiment must not hold a worker's slots for a day.
_RecordSeconds = Annotated[
    float, Meta(ge=MIN_RECORD_SECONDS, le=3600, description="a duration in seconds, at least 0.1, at most an hour")
]
_Rate = Annotated[float, Meta(ge=MIN_RECORD_RPS, le=100_000)]
_Count = Annotated[int, Meta(ge=1, le=100_000)]


class LengthBudgetRecordSettings(RecordSettings, frozen=True):
    max_output_tokens: Annotated[int, Meta(ge=1, le=100_000_000)] | UnsetType = UNSET


class JudgeRecordSettings(RecordSettings, frozen=True):
    """The judge scorers' tuning: URLs (held to the worker's judge host allow-list), the
    judge request, voting and failure policy, time limits, retries, limits and pool routing."""

    base_url: _Url | UnsetType = UNSET
    base_urls: _Urls | UnsetType = UNSET
    api: JudgeApi | UnsetType = UNSET
    model: Annotated[str, Meta(min_length=1, max_length=256)] | UnsetType = UNSET
    temperature: Annotated[float, Meta(ge=0, le=10)] | UnsetType = UNSET
    max_tokens: Annotated[int, Meta(ge=1, le=1_000_000)] | UnsetType = UNSET
    top_p: Annotated[float, Meta(gt=0, le=1)] | None | UnsetType = UNSET
    top_k: Annotated[int, Meta(ge=-1, le=1_000_000)] | None | UnsetType = UNSET
    include_reasoning: bool | UnsetType = UNSET
    next_state: NextStateRule | UnsetType = UNSET
    merge_tool_results: bool | UnsetType = UNSET
    m: Annotated[int, Meta(ge=1, le=64)] | UnsetType = UNSET
    on_all_votes_failed: FailurePolicy | UnsetType = UNSET
    timeout_s: _RecordSeconds | UnsetType = UNSET
    total_timeout_s: _RecordSeconds | UnsetType = UNSET
    turn_timeout_s: _RecordSeconds | None | UnsetType = UNSET
    max_retries: Annotated[int, Meta(ge=0, le=20)] | UnsetType = UNSET
    backoff_base_s: Annotated[float, Meta(ge=0, le=60)] | UnsetType = UNSET
    backoff_max_s: Annotated[float, Meta(ge=0, le=600)] | UnsetType = UNSET
    max_concurrency: _Count | None | UnsetType = UNSET
    rps: _Rate | None | UnsetType = UNSET
    breaker_failure_threshold: Annotated[int, Meta(ge=1, le=10_000)] | None | UnsetType = UNSET
    breaker_reset_s: _RecordSeconds | None | UnsetType = UNSET
    spill_in_flight: _Count | UnsetType = UNSET
    spill_ratio: Annotated[float, Meta(ge=1, le=100)] | UnsetType = UNSET


class OpenClawRecordSettings(JudgeRecordSettings, frozen=True):
    adaptive: bool | UnsetType = UNSET
    max_votes: Annotated[int, Meta(ge=1, le=1024)] | None | UnsetType = UNSET


class OPDRecordSettings(JudgeRecordSettings, frozen=True):
    teacher_base_url: _Url | UnsetType = UNSET
    teacher_base_urls: _Urls | UnsetType = UNSET


JUDGE_OPERATOR_ONLY: Final[Mapping[str, str]] = MappingProxyType(
    {
        "api_key_env": "reads a variable of the worker's environment and sends it to the judge",
        "api_key_file": "reads a file on the worker and sends it to the judge",
        "headers": "sets request headers (credentials, routing) on every judge call",
        "chat_template": "imports and runs a callable (module:callable)",
        "audit_sink": "imports and runs a callable (module:callable)",
        "policy_tokenizer": "reads a tokenizer file on the worker",
    }
)

OPD_OPERATOR_ONLY: Final[Mapping[str, str]] = MappingProxyType(
    {
        **JUDGE_OPERATOR_ONLY,
        "tokenizer": "loads code: an hf: tokenizer (downloads and reads files) or a module:callable",
        "trust_remote_code": "lets a Hugging Face tokenizer run the Python code its files name",
        "tokenize_path": "chooses the URL path the teacher's tokenize requests go to",
    }
)
