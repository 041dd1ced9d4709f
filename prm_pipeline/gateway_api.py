"""The reward gateway's wire contract: every request and answer body as a msgspec struct.

Requests are decoded straight from bytes into these types (``msgspec.json.decode(body,
type=...)``), so a body is data of a declared shape or it is refused with 400 before any
of it is read: a field of the wrong type, a token id outside int32, a mask value other
than 0/1, a list over its bound or (on ``/v1/score``) a field the body or one of its
samples does not declare never reaches the pipeline. msgspec names the offending place in
its error (``Expected `int` >= 0 - at `$.samples[0].response_ids[3]```); the gateway
answers it as ``{"error": ...}``.

Chat messages are data, not declared fields: a ``/v1/score`` sample's ``messages`` are
free-form chat messages (OpenAI's format: ``role``, ``content``, ``name``, ``tool_calls``,
``tool_call_id``, ...), whose keys are not checked, so that tool messages and whatever a
chat format adds keep working. They are bounded (at most :data:`MAX_MESSAGES`, nested at
most :data:`MAX_DEPTH` levels, within the body's size) and passed on to the scorers as the
trajectory's messages; nothing in them is read as configuration.

The same types generate the OpenAPI 3.1 document (:func:`openapi_document`), served at
``GET /openapi.json`` and committed as ``docs/integrations/gateway-openapi.json`` (a unit
test keeps the two equal; ``python -m prm_pipeline.gateway_api`` rewrites the file).

Bounds here are static: they are the document's promise to every client. The operator's
limits (``gateway.max_items``, ``gateway.max_body_bytes``) are checked on top and can only
be tighter (``gateway.max_items`` may not exceed :data:`MAX_ITEMS`).

Unknown fields: ``/v1/score`` is this project's own API and refuses them in the body and in
each sample, so a field such as ``scorers`` or ``topic`` cannot be mistaken for
configuration (the keys of a chat message, above, are not fields). ``/openrlhf`` and
``/slime`` speak other projects' protocols (OpenRLHF's remote reward model, slime's
``remote_rm``); those clients are not ours to change, and a release that adds a field to
its payload would otherwise turn every reward call into a 400, which OpenRLHF retries and
then trains without a reward. So those two routes ignore (never read) fields they do not
declare; nothing they could carry is configuration either way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from infra.schema import SchemaError
from infra.types import Finite, Int64, TokenId

# --------------------------------------------------------------------------- static bounds
MAX_ITEMS = 4096
"""Queries, prompts, labels or samples in one request: the ceiling for ``gateway.max_items``."""
MAX_TOKENS = 1 << 20
"""Token ids (and log-probs, mask values) in one list: about a 1M-token context."""
MAX_TEXT = 1 << 22
"""Characters in one string (a query, a prompt, a response, a message's content)."""
MAX_MESSAGES = 4096
"""Chat messages in one prompt."""
MAX_DEPTH = 32
"""Nesting of free-form JSON (``labels``, ``label``, a message's fields): decoding deeper
structures recurses, so they are refused rather than followed."""
MAX_BODY_DEPTH = 2 * MAX_DEPTH
"""Nesting of a whole body, checked on its bytes before decoding (the declared structure adds
at most five levels above a free-form field, whose own bound names the field)."""

TokenIds = Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKENS)]
LogProb = Annotated[float, msgspec.Meta(ge=-3.4e38, le=3.4e38, description="finite, float32 range")]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Status = Literal["accepted", "rejected", "discarded"]


def check_depth(value: Any, field: str, limit: int = MAX_DEPTH) -> None:
    """Refuse free-form JSON nested deeper than ``limit`` (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise SchemaError(f"`{field}` nests deeper than {limit} levels")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack += [(v, depth + 1) for v in children if isinstance(v, (dict, list))]


# --------------------------------------------------------------------------- requests
class OpenRLHFRequest(msgspec.Struct):
    """OpenRLHF's remote reward-model request, as ``SingleTurnAgentExecutor._fetch_rewards_via_http``
    (OpenRLHF 0.11.2) posts it: ``query[i]`` is prompt + response text, ``prompts[i]`` the prompt
    it starts with. Fields not declared here are ignored, not refused: the client is OpenRLHF's,
    and a new field in its payload must not turn every reward call into an error."""

    query: Annotated[list[Text], msgspec.Meta(min_length=1, max_length=MAX_ITEMS)]
    prompts: Annotated[list[Text], msgspec.Meta(min_length=1, max_length=MAX_ITEMS)]
    labels: Annotated[list[Any], msgspec.Meta(max_length=MAX_ITEMS)] | None = None

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.query):
            raise SchemaError(f"`prompts` has {len(self.prompts)} items for {len(self.query)} queries (one per query)")
        if self.labels is not None:
            if len(self.labels) != len(self.query):
                raise SchemaError(
                    f"`labels` has {len(self.labels)} items for {len(self.query)} queries (one per query, or null)"
                )
            check_depth(self.labels, "labels")


class ChatMessage(msgspec.Struct):
    """One chat message of a slime prompt. Only ``role`` and ``content`` are read; other keys a
    message may carry in slime (tool calls, names) are ignored."""

    content: Text
    role: Annotated[str, msgspec.Meta(max_length=256)] = "user"


class SlimeRequest(msgspec.Struct):
    """slime's ``remote_rm`` request (``slime/rollout/rm_hub/__init__.py``): one sample's prompt
    (text or chat messages) and response. ``label`` is accepted and ignored. Fields not declared
    here are ignored, not refused: the client is slime's."""

    prompt: Text | Annotated[list[ChatMessage], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    response: Text
    label: Any = None

    def __post_init__(self) -> None:
        check_depth(self.label, "label")


class ScoreSample(msgspec.Struct, forbid_unknown_fields=True):
    """One sample as token ids. Unknown fields of the sample are refused: a request carries
    samples, never configuration, and a misspelt field must not be silently dropped. Its
    ``messages`` are free-form chat messages (keys not checked; bounded in count and nesting),
    passed on as data."""

    prompt_ids: TokenIds
    response_ids: TokenIds
    response_logprobs: Annotated[list[LogProb], msgspec.Meta(max_length=MAX_TOKENS)] | None = None
    response_mask: Annotated[list[Literal[0, 1]], msgspec.Meta(max_length=MAX_TOKENS)] | None = None
    outcome_reward: Finite = 0.0
    messages: Annotated[
        list[dict[str, Any]],
        msgspec.Meta(
            max_length=MAX_MESSAGES,
            description=f"free-form chat messages (OpenAI format: role, content, name, tool_calls, ...; keys not "
            f"checked), nested at most {MAX_DEPTH} levels; passed on to the scorers as data",
        ),
    ] = msgspec.field(default_factory=list)
    truncated: bool = False
    policy_version: Int64 | None = None
    is_eval: bool = False

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        for name in ("response_logprobs", "response_mask"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise SchemaError(f"`{name}` has {len(values)} values for {n} response tokens (one per response_ids)")
        check_depth(self.messages, "messages")


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/score``: the samples of one group (send a GRPO group whole). Unknown fields are
    refused: nothing in a request chooses scorers, topics, experiments or limits."""

    samples: Annotated[list[ScoreSample], msgspec.Meta(min_length=1, max_length=MAX_ITEMS)]


# --------------------------------------------------------------------------- answers
class OpenRLHFExtraLogs(msgspec.Struct):
    """Per-query floats OpenRLHF logs next to the reward."""

    prm_outcome: list[float]
    prm_process: list[float]
    prm_accepted: list[float]


class OpenRLHFResponse(msgspec.Struct):
    """OpenRLHF's remote reward-model answer (``rewards``, ``scores``, ``extra_logs``) plus the
    verdict's status, reason code and reason per query."""

    rewards: list[float]
    scores: list[float]
    extra_logs: OpenRLHFExtraLogs
    status: list[Status]
    reason_code: list[str]
    reason: list[str]


class SlimeResponse(msgspec.Struct):
    """slime's ``remote_rm`` answer: ``score`` (= outcome + process) is what ``--reward-key score``
    trains on; the rest says where it came from."""

    score: float
    outcome: float
    process: float
    status: Status
    reason_code: str
    reason: str
    group_id: str
    token_rewards: list[float]
    turn_rewards: list[float]


class ScoredSample(msgspec.Struct):
    """One sample's rewards, in request order."""

    trajectory_id: str
    status: Status
    outcome: float
    token_rewards: list[float]
    turn_rewards: list[float]


class ScoreResponse(msgspec.Struct):
    """``POST /v1/score``'s answer: the group's verdict and each sample's per-token rewards."""

    group_id: str
    status: Status
    reason_code: str
    reason: str
    samples: list[ScoredSample]


class TurnPublished(msgspec.Struct):
    """``POST /v1/turn``'s answer: the turn is published (acknowledged by the broker)."""

    published: Literal["turn"]
    trajectory_id: str
    interaction_id: str


class EndResponse(msgspec.Struct):
    """``POST /v1/end``'s answer: the session's group's verdict, once its last member ended.
    Per-token rewards of streamed sessions are in the verdict (``prm-pipeline verdicts``)."""

    group_id: str
    status: Status
    reason_code: str
    reason: str


class Error(msgspec.Struct):
    """Every error the gateway answers (4xx, 5xx): one line naming the field or setting."""

    error: str


# --------------------------------------------------------------------------- OpenAPI 3.1
_REF = "#/components/schemas/{name}"
_ERRORS = {
    "400": "bad input: not JSON, a field of the wrong type, range or length, an unknown field of the body or "
    "of a sample (on /v1/score), JSON nested too deeply, or a malformed HTTP request",
    "401": "bearer tokens are configured and the Authorization header is missing or wrong",
    "404": "no such route",
    "405": "the route does not take this method (see the Allow header)",
    "408": "the body did not arrive within gateway.read_timeout_s",
    "413": "the body is over gateway.max_body_bytes",
    "429": "over gateway.max_in_flight or gateway.max_in_flight_per_client requests in flight",
    "431": "a request line or header field over 8190 bytes, or over 128 headers",
    "504": "no verdict within gateway.verdict_timeout_s (the trajectories are published)",
}
_HEADERS = {
    "401": {"WWW-Authenticate": {"required": True, "schema": {"type": "string", "const": "Bearer"}}},
    "405": {"Allow": {"required": True, "schema": {"type": "string"}}},
    "429": {"Retry-After": {"required": True, "schema": {"type": "string"}}},
}
_POSTS: dict[str, tuple[str, type[msgspec.Struct], type[msgspec.Struct], str]] = {
    "/openrlhf": (
        "openrlhf",
        OpenRLHFRequest,
        OpenRLHFResponse,
        "OpenRLHF's remote reward model (`--reward.remote_url http://HOST:8431/openrlhf`).",
    ),
    "/slime": (
        "slime",
        SlimeRequest,
        SlimeResponse,
        "slime's remote reward model (`--rm-type remote_rm --rm-url http://HOST:8431/slime`).",
    ),
    "/v1/score": (
        "score",
        ScoreRequest,
        ScoreResponse,
        "Token ids in, per-token process rewards out; the samples are scored as one group.",
    ),
}


_STREAM_POSTS: dict[str, tuple[str, str, type[msgspec.Struct], str]] = {
    "/v1/turn": (
        "turn",
        "turn",
        TurnPublished,
        "One turn of a streamed session, as soon as the agent produced it: the body is one `turn` line of "
        "docs/jsonl.md (`kind`, the session's ids, `interaction`); its judge work starts when the next turn "
        "(or the end) arrives. Answers once it is published.",
    ),
    "/v1/end": (
        "end",
        "end",
        EndResponse,
        "The end of a streamed session: the body is one `end` line of docs/jsonl.md (`kind`, the session's "
        "ids, `outcome_reward`, ...). Answers with the group's verdict once its last member ended.",
    ),
}


def _error_responses(codes: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for code in codes:
        out[code] = {
            "description": _ERRORS[code],
            "content": {"application/json": {"schema": {"$ref": _REF.format(name="Error")}}},
        }
        if code in _HEADERS:
            out[code]["headers"] = _HEADERS[code]
    return out


def _text(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}}


def openapi_document() -> dict[str, Any]:
    """The gateway's OpenAPI 3.1 document, generated from the structs above."""
    structs = (
        [t for _, req, resp, _ in _POSTS.values() for t in (req, resp)]
        + [resp for _, _, resp, _ in _STREAM_POSTS.values()]
        + [Error]
    )
    _, components = msgspec.json.schema_components(structs, ref_template=_REF)
    paths: dict[str, Any] = {}
    for path, (op_id, request, response, summary) in _POSTS.items():
        paths[path] = {
            "post": {
                "operationId": op_id,
                "summary": summary,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": _REF.format(name=request.__name__)}}},
                },
                "responses": {
                    "200": {
                        "description": "the verdict (a group not accepted is still a 200: see `status`)",
                        "content": {"application/json": {"schema": {"$ref": _REF.format(name=response.__name__)}}},
                    },
                    **_error_responses(("400", "401", "408", "413", "429", "431", "504")),
                },
            }
        }
    for path, (op_id, kind, response, summary) in _STREAM_POSTS.items():
        paths[path] = {
            "post": {
                "operationId": op_id,
                "summary": summary,
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["kind"],
                                "properties": {"kind": {"const": kind}},
                                "description": f"one `{kind}` line of docs/jsonl.md, validated as `prm-pipeline "
                                "publish` does "
                                "(unknown fields refused)",
                            }
                        }
                    },
                },
                "responses": {
                    "200": {
                        "description": "published" if kind == "turn" else "the group's verdict",
                        "content": {"application/json": {"schema": {"$ref": _REF.format(name=response.__name__)}}},
                    },
                    **_error_responses(
                        ("400", "401", "408", "413", "429", "431") + (("504",) if kind == "end" else ())
                    ),
                },
            }
        }
    paths["/openapi.json"] = {
        "get": {
            "operationId": "openapi",
            "summary": "This document (behind the bearer tokens when they are set).",
            "responses": {
                "200": {
                    "description": "the OpenAPI document",
                    "content": {"application/json": {"schema": {"type": "object"}}},
                },
                **_error_responses(("401", "431")),
            },
        }
    }
    paths["/metrics"] = {
        "get": {
            "operationId": "metrics",
            "summary": "Prometheus metrics (behind the bearer tokens when they are set).",
            "responses": {"200": _text("Prometheus text format"), **_error_responses(("401", "431"))},
        }
    }
    paths["/healthz"] = {
        "get": {
            "operationId": "healthz",
            "summary": "Liveness probe (no token needed).",
            "security": [{}],
            "responses": {"200": _text("`ok`"), **_error_responses(("431",))},
        }
    }
    paths["/readyz"] = {
        "get": {
            "operationId": "readyz",
            "summary": "Readiness probe (no token needed).",
            "security": [{}],
            "responses": {
                "200": _text("`ready`: the Kafka producer and the verdict reader started"),
                "503": _text("`starting`"),
                **_error_responses(("431",)),
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "prm-pipeline reward gateway",
            "version": "1",
            "description": "Process rewards over HTTP (docs/integrations/gateway.md). Generated from "
            "prm_pipeline/gateway_api.py; every error body is `Error`. Unknown fields are "
            "refused on /v1/score and ignored on the framework routes /openrlhf and /slime.",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "gateway.auth_tokens_env / auth_tokens_file; "
                    "without them the gateway takes no token",
                }
            },
        },
        "security": [{"bearer": []}, {}],
    }


def openapi_json() -> str:
    """:func:`openapi_document` as the committed file's text (2-space indent, trailing newline)."""
    return json.dumps(openapi_document(), indent=2, ensure_ascii=False) + "\n"


COMMITTED = Path("docs") / "integrations" / "gateway-openapi.json"
"""Where the document is committed, relative to the repository root."""

if __name__ == "__main__":  # python -m prm_pipeline.gateway_api [PATH]: rewrite the committed document
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / COMMITTED
    target.write_text(openapi_json(), encoding="utf-8")
    print(f"wrote {target}")
