"""The gateway's declared request structs and the OpenAPI document generated from them.

The committed ``docs/integrations/gateway-openapi.json`` must be exactly what the code
generates (rewrite it with ``python -m prm_pipeline.gateway_api``), so the document a
client reads never drifts from what the gateway enforces.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from infra.config import ConfigError, GatewayConfig, PipelineConfig
from prm_pipeline.gateway import BadRequest, BodyTooLarge, Gateway, decode
from prm_pipeline.gateway_api import (
    COMMITTED,
    MAX_BODY_DEPTH,
    MAX_DEPTH,
    MAX_ITEMS,
    OpenRLHFRequest,
    ScoreRequest,
    SlimeRequest,
    openapi_document,
    openapi_json,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_openapi_document_is_the_generated_one() -> None:
    committed = (ROOT / COMMITTED).read_text(encoding="utf-8")
    assert committed == openapi_json(), (
        f"{COMMITTED} is stale: run `python -m prm_pipeline.gateway_api` and commit the result"
    )


def test_the_document_is_valid_openapi_3_1_and_declares_every_route_and_error() -> None:
    import openapi_spec_validator

    doc = openapi_document()
    openapi_spec_validator.validate(doc)
    assert doc["openapi"] == "3.1.0"
    for path in ("/openrlhf", "/slime", "/v1/score"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "408", "413", "429", "431", "504"} <= set(responses), path
        assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    schemas = doc["components"]["schemas"]
    assert schemas["ScoreRequest"]["additionalProperties"] is False  # our API refuses unknown fields ...
    assert schemas["ScoreSample"]["additionalProperties"] is False
    assert "additionalProperties" not in schemas["OpenRLHFRequest"]  # ... the frameworks' routes ignore them
    assert "additionalProperties" not in schemas["SlimeRequest"]
    mask = schemas["ScoreSample"]["properties"]["response_mask"]["anyOf"][0]
    assert mask["items"] == {"enum": [0, 1]}
    ids = schemas["ScoreSample"]["properties"]["prompt_ids"]["items"]
    assert (ids["minimum"], ids["maximum"]) == (0, 2**31 - 1)


@pytest.mark.parametrize(
    ("kind", "body", "error"),
    [
        (
            ScoreRequest,
            b'{"samples": [{"prompt_ids": [1], "response_ids": [2, 3], "response_mask": [1, 2]}]}',
            "Invalid enum value 2 - at `$.samples[0].response_mask[1]`",
        ),
        (
            ScoreRequest,
            b'{"samples": [{"prompt_ids": [1], "response_ids": [2]}], "topic": "x"}',
            "Object contains unknown field `topic` - at `$`",
        ),
        (
            ScoreRequest,
            b'{"samples": [{"prompt_ids": [1], "response_ids": [2], "policy_version": 99999999999999999999}]}',
            "Expected `int` <= 9223372036854775807 - at `$.samples[0].policy_version`",
        ),
        (
            ScoreRequest,
            b'{"samples": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            f"body nests JSON deeper than {MAX_BODY_DEPTH} levels - at `$`",
        ),
        (
            SlimeRequest,
            b'{"prompt": "p", "response": "r", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            f"body nests JSON deeper than {MAX_BODY_DEPTH} levels - at `$`",
        ),  # refused before decoding
        (
            SlimeRequest,
            b'{"prompt": "p", "response": "r", "label": ' + b"[" * (MAX_DEPTH + 2) + b"]" * (MAX_DEPTH + 2) + b"}",
            f"`label` nests deeper than {MAX_DEPTH} levels - at `$`",
        ),
        (
            OpenRLHFRequest,
            b'{"query": ["ab"], "prompts": ["a"], "labels": ["x", "y"]}',
            "`labels` has 2 items for 1 queries (one per query, or null) - at `$`",
        ),
        (
            OpenRLHFRequest,
            b"{not json",
            "body is not valid JSON (JSON is malformed: object keys must be strings (byte 1))",
        ),
    ],
)
def test_a_malformed_body_is_a_bad_request_naming_the_field(kind, body, error) -> None:
    with pytest.raises(BadRequest) as caught:
        decode(body, kind)
    assert str(caught.value) == error


def test_what_the_frameworks_send_decodes() -> None:
    # OpenRLHF 0.11.2 (labels may be anything its dataset holds, or null) and slime (a prompt string or messages)
    openrlhf = decode(b'{"query": ["Q: A: 4"], "prompts": ["Q: A:"], "labels": [{"answer": 4}]}', OpenRLHFRequest)
    assert openrlhf.labels == [{"answer": 4}]
    assert decode(b'{"query": ["x"], "prompts": ["x"], "labels": null}', OpenRLHFRequest).labels is None
    slime = decode(
        b'{"prompt": [{"role": "system", "content": "s", "name": "n"}, {"content": "u"}], "response": "r",'
        b' "label": "4", "metadata": {}}',
        SlimeRequest,
    )
    assert [(m.role, m.content) for m in slime.prompt] == [("system", "s"), ("user", "u")]


def test_a_body_over_the_size_bound_is_a_413_and_bytes_that_are_not_utf8_a_400() -> None:
    with pytest.raises(BodyTooLarge) as caught:
        decode(b'{"query": ["x"], "prompts": ["x"]}', OpenRLHFRequest, max_bytes=10)
    assert caught.value.status == 413 and str(caught.value) == "request body over gateway.max_body_bytes=10"
    with pytest.raises(BadRequest) as caught:
        decode(b'{"query": ["\xff"], "prompts": ["x"]}', OpenRLHFRequest)
    assert caught.value.status == 400 and str(caught.value).startswith("body is not valid JSON ("), caught.value


def test_score_messages_are_free_form_chat_messages_but_the_samples_fields_are_not() -> None:
    """A message's keys are not checked (tool calls, names, tool results pass as data); the
    sample's own fields are, and a message is still bounded in nesting."""
    messages = [
        {"role": "user", "content": "2+2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "calc", "content": "4"},
    ]
    body = msgspec.json.encode({"samples": [{"prompt_ids": [1], "response_ids": [2], "messages": messages}]})
    assert decode(body, ScoreRequest).samples[0].messages == messages
    with pytest.raises(BadRequest) as caught:
        decode(body.replace(b'"messages"', b'"scorers": [], "messages"'), ScoreRequest)
    assert str(caught.value) == "Object contains unknown field `scorers` - at `$.samples[0]`"
    deep = b'{"a": ' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1)
    with pytest.raises(BadRequest, match=f"`messages` nests deeper than {MAX_DEPTH} levels"):
        decode(b'{"samples": [{"prompt_ids": [], "response_ids": [], "messages": [' + deep + b"]}]}", ScoreRequest)


def test_an_unknown_field_name_is_cut_in_the_error() -> None:
    with pytest.raises(BadRequest) as caught:
        decode(b'{"samples": [{"prompt_ids": [], "response_ids": []}], "' + b"k" * 100_000 + b'": 1}', ScoreRequest)
    assert len(str(caught.value)) <= 301 and str(caught.value).endswith("- at `$`")


def test_max_items_may_not_exceed_what_the_document_promises() -> None:
    cfg = PipelineConfig(gateway=GatewayConfig(max_items=MAX_ITEMS + 1))
    with pytest.raises(ConfigError, match="gateway.max_items"):
        Gateway(cfg)


def test_the_document_is_json_serializable_as_served() -> None:
    assert json.loads(msgspec.json.encode(openapi_document())) == openapi_document()
