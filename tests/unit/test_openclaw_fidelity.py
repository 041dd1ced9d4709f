"""OpenClaw-RL fidelity of the judge scorers, with concrete upstream values, against the real fake judge.

Next-state selection is covered in test_judge_parsing.py; the trainer recipes in
test_openclaw_recipe.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from infra.schema import Interaction, ModelResponse
from prm_pipeline.demo.fake_judge import FakeJudgeServer, fake_teacher_logprob, fake_tokenize
from scoring_workers.judge.errors import JudgeFailedError
from scoring_workers.scorers.conversation import render_chatml
from scoring_workers.scorers.opd import OPDTeacherScorer
from scoring_workers.scorers.openclaw import OpenClawJudgeScorer
from scoring_workers.scorers.policy_tokenizer import load_policy_decoder

USER = {"role": "user", "content": "Create notes.txt"}
OUT = {
    "role": "assistant",
    "content": "Creating it.",
    "reasoning_content": "The user wants a file.",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "touch", "arguments": '{"p": "notes.txt"}'}}],
}
TOOL = {"role": "tool", "content": "success: created", "tool_call_id": "c1"}
NEXT = {"role": "assistant", "content": "Done."}
# What a Qwen3-style policy generated for OUT, special tokens included: the judge's upstream view.
GENERATED = (
    "<think>\nThe user wants a file.\n</think>\n\nCreating it.\n<tool_call>\n"
    '{"name": "touch", "arguments": {"p": "notes.txt"}}\n</tool_call><|im_end|>'
)
SPECIAL = ["<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]


@pytest.fixture
def server():
    with FakeJudgeServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
    """A byte-level tokenizer.json with the template's special tokens (no download, no transformers)."""
    tok = Tokenizer(
        models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[])
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    path = tmp_path_factory.mktemp("policy") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _turn(output_ids: list[int], logprobs: bool = False) -> tuple[Interaction, dict]:
    lps = -np.linspace(0.1, 1.0, len(output_ids), dtype=np.float32) if logprobs else None
    response = ModelResponse.from_arrays(np.arange(3, dtype=np.int32), np.asarray(output_ids, dtype=np.int32), lps)
    turn = Interaction(interaction_id="t0", messages=[USER], output_message_list=[OUT], model_response=response)
    return turn, {"messages": (USER, OUT, TOOL, NEXT)}


def _kwargs(url: str, **extra) -> dict:
    return {"base_url": url, "model": "fake", "max_retries": 0, **extra}


def _assistant_output(payload: dict) -> str:
    user = payload["messages"][1]["content"]
    return user.split("## Assistant output\n", 1)[1].split("\n\n## Next state", 1)[0]


# --------------------------------------------------------------------------- what the judge sees
async def test_policy_tokenizer_gives_upstreams_template_view(server, tokenizer_json):
    ids = Tokenizer.from_file(tokenizer_json).encode(GENERATED).ids
    assert load_policy_decoder(tokenizer_json)(ids) == GENERATED
    turn, ctx = _turn(ids)
    upstream = OpenClawJudgeScorer(**_kwargs(server.base_url, policy_tokenizer=tokenizer_json, m=1))
    try:
        assert await upstream.evaluate(turn, ctx) == 1.0  # "success" -> \boxed{1}
    finally:
        await upstream.aclose()
    # Thinking, the template's tool-call markup and the end-of-turn marker, exactly as generated.
    assert _assistant_output(server.last_chat_payload) == GENERATED


async def test_without_policy_tokenizer_the_judge_sees_our_message_view(server, tokenizer_json):
    turn, ctx = _turn(Tokenizer.from_file(tokenizer_json).encode(GENERATED).ids)
    ours = OpenClawJudgeScorer(**_kwargs(server.base_url, m=1))
    try:
        await ours.evaluate(turn, ctx)
    finally:
        await ours.aclose()
    assert _assistant_output(server.last_chat_payload) == (
        'Creating it.\n<tool_call>{"name": "touch", "arguments": {"p": "notes.txt"}}</tool_call>'
    )  # no thinking, no template markup


def test_policy_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_policy_decoder(str(tmp_path))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="cannot load"):
        load_policy_decoder(str(bad))


# --------------------------------------------------------------------------- sampling and parsing
async def test_openai_mode_sends_upstream_sampling(server):
    turn, ctx = _turn([1, 2])
    scorer = OpenClawJudgeScorer(**_kwargs(server.base_url, m=1))
    try:
        await scorer.evaluate(turn, ctx)
        sent = server.last_chat_payload
        assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["max_tokens"]) == (0.6, 1.0, -1, 4096)
        assert "n" not in sent and sent["stream"] is False
    finally:
        await scorer.aclose()


async def test_top_k_can_be_left_out_for_servers_that_refuse_it(server):
    turn, ctx = _turn([1, 2])
    scorer = OpenClawJudgeScorer(**_kwargs(server.base_url, m=1, top_k=None, top_p=None))
    try:
        await scorer.evaluate(turn, ctx)
    finally:
        await scorer.aclose()
    assert "top_k" not in server.last_chat_payload and "top_p" not in server.last_chat_payload
    with pytest.raises(ValueError, match="top_k"):
        OpenClawJudgeScorer(**_kwargs(server.base_url, top_k=0))


async def test_a_box_only_in_the_reasoning_counts_as_upstream():
    turn, ctx = _turn([1, 2])
    with FakeJudgeServer(reasoning=True) as srv:
        upstream = OpenClawJudgeScorer(**_kwargs(srv.base_url))
        content_only = OpenClawJudgeScorer(**_kwargs(srv.base_url, include_reasoning=False))
        try:
            # OpenClaw-RL parses the raw generation, thinking included: the box in the thinking decides.
            assert await upstream.evaluate(turn, ctx) == 1.0
            # Ours before (content only): no box anywhere -> every vote invalid -> rejected.
            with pytest.raises(JudgeFailedError):
                await content_only.evaluate(turn, ctx)
        finally:
            await upstream.aclose()
            await content_only.aclose()


# --------------------------------------------------------------------------- OPD
CAPTURED: list[list[dict]] = []


def capturing_tokenizer(messages) -> list[int]:
    CAPTURED.append([dict(m) for m in messages])
    return fake_tokenize(render_chatml(messages))


async def test_opd_maps_developer_to_system_in_the_hinted_prompt(server):
    developer = {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}
    user = {"role": "user", "content": "Read /root"}
    out = {"role": "assistant", "content": "Reading."}
    tool = {"role": "tool", "content": "Error: permission denied"}
    response = ModelResponse.from_arrays(
        np.arange(3, dtype=np.int32), np.array([70, 71], dtype=np.int32), np.array([-0.5, -0.5], dtype=np.float32)
    )
    turn = Interaction(
        interaction_id="t0", messages=[developer, user], output_message_list=[out], model_response=response
    )
    CAPTURED.clear()
    scorer = OPDTeacherScorer(**_kwargs(server.base_url, tokenizer=capturing_tokenizer))
    try:
        result = await scorer.evaluate_result(turn, {"messages": (developer, user, out, tool, NEXT)})
    finally:
        await scorer.aclose()
    (prompt,) = CAPTURED
    assert [m["role"] for m in prompt] == ["system", "user"] and prompt[0]["content"] == "Be brief."
    assert prompt[1]["content"].startswith("Read /root\n\n[user's hint / instruction]\nThe environment answered:")
    # Our deviation, kept: the teacher log-prob of output token 0 is real. OpenClaw-RL's start
    # L - R plus "drop the first entry" makes it 0.0 for every turn (so its signal is 0.0 - old).
    expected0 = fake_teacher_logprob(70, hinted=True) - (-0.5)
    assert result.reward[0].item() == pytest.approx(expected0) and result.reward[0].item() != pytest.approx(0.5)
