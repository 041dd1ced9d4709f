"""A producer in another language: examples/node-producer (kafkajs + @msgpack/msgpack) against the pipeline.

Real broker, real Redis, two real worker processes; the producer is the example's own
``produce.js`` run by node. ``make test-ecosystem`` runs ``npm ci`` there first.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from pathlib import Path

import msgspec
import numpy as np
import pytest

from infra.config import PipelineConfig, PRMScorerConfig
from infra.schema import dead_letter_from_record, decode_message
from tests.integration.harness import (
    TEST_SCORER_MODULES,
    isolated_config,
    read_topic,
    wait_for_verdicts,
    worker_processes,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PRODUCER = ROOT / "examples" / "node-producer"
VECTORS = ROOT / "tests" / "vectors"


@pytest.fixture(scope="module")
def node() -> str:
    exe = shutil.which("node")
    assert exe, "node (v18+) is needed on PATH for the Node producer test"
    assert (PRODUCER / "node_modules" / "kafkajs").is_dir(), (
        f"run `npm ci` in {PRODUCER} first (make test-ecosystem does)"
    )
    return exe


async def run_node(node: str, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        node,
        str(PRODUCER / "produce.js"),
        *args,
        cwd=PRODUCER,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, f"produce.js failed ({proc.returncode}): {err.decode()}"
    return out.decode()


@pytest.fixture(scope="module")
def cfg(kafka_bootstrap: str, redis_url: str) -> PipelineConfig:
    return isolated_config(
        f"node-{uuid.uuid4().hex[:8]}",
        kafka_bootstrap,
        redis_url,
        scorer_timeout_s=5,
        group_timeout_s=30,
        allowed_scorer_modules=[*TEST_SCORER_MODULES, "tests.ecosystem"],
        scorers=[PRMScorerConfig("tests.ecosystem.scorers.TokenParityScorer")],
    )


@pytest.fixture(scope="module")
async def workers(cfg: PipelineConfig, tmp_path_factory: pytest.TempPathFactory):
    async with worker_processes(cfg, tmp_path_factory.mktemp("node-workers")) as procs:
        yield procs


def _description(tmp_path: Path, group: dict) -> str:
    path = tmp_path / f"{group['group_id']}.json"
    path.write_text(json.dumps(group))
    return str(path)


async def test_node_encoding_decodes_to_the_golden_vector(node: str, tmp_path: Path) -> None:
    """The golden ``ready`` vector rebuilt from its JSON twin by the Node producer decodes to the same message."""
    twin = json.loads((VECTORS / "ready_single_turn.json").read_text())["value"]
    interactions = []
    for it in twin["interactions"]:
        mr = it["model_response"]
        interactions.append(
            {
                "interaction_id": it["interaction_id"],
                "messages": it["messages"],
                "output_message_list": it["output_message_list"],
                "stop_reason": mr["stop_reason"],
                **{k: mr[k]["values"] for k in ("input_tokens", "output_tokens", "output_logprobs")},
            }
        )
    group = {
        "group_id": twin["group_id"],
        "group_size": twin["group_size"],
        "sessions": [
            {
                "trajectory_id": twin["trajectory_id"],
                "session_id": twin["session_id"],
                "outcome_reward": twin["outcome_reward"],
                "policy_version": twin["policy_version"],
                "created_at": twin["created_at"],
                "interactions": interactions,
            }
        ],
    }
    (line,) = (await run_node(node, "--dry-run", _description(tmp_path, group))).splitlines()
    record = json.loads(line)
    headers = [(k, v.encode()) for k, v in record["headers"].items()]
    golden = decode_message((VECTORS / "ready_single_turn.msgpack").read_bytes(), headers)
    assert record["key"] == golden.group_id
    assert decode_message(bytes.fromhex(record["value_hex"]), headers) == golden


def _node_description(traj) -> dict:
    """A full-form ReadyTrajectory as produce.js's JSON description."""
    interactions = []
    for it in traj.interactions:
        mr = it.model_response
        entry = {
            "interaction_id": it.interaction_id,
            "messages": it.messages,
            "output_message_list": it.output_message_list,
            "stop_reason": mr.stop_reason,
            "input_tokens": mr.input_tokens.tolist(),
            "output_tokens": mr.output_tokens.tolist(),
            "output_logprobs": mr.output_logprobs.tolist(),
        }
        if it.parent_id is not None:
            entry["parent_id"] = it.parent_id
        interactions.append(entry)
    return {
        "group_id": traj.group_id,
        "group_size": traj.group_size,
        "sessions": [
            {
                "trajectory_id": traj.trajectory_id,
                "session_id": traj.session_id,
                "outcome_reward": traj.outcome_reward,
                "policy_version": traj.policy_version,
                "created_at": traj.created_at,
                "interactions": interactions,
            }
        ],
    }


def _records(out: str) -> list[tuple[bytes, list[tuple[str, bytes]]]]:
    lines = [json.loads(line) for line in out.splitlines()]
    return [(bytes.fromhex(r["value_hex"]), [(k, v.encode()) for k, v in r["headers"].items()]) for r in lines]


async def test_node_sends_the_compact_form_of_the_golden_vector(node: str, tmp_path: Path) -> None:
    """The session behind the ``ready_compact`` vector, given in full, leaves produce.js compact
    (version 2, the same sharing as our writer) and expands back to the same session."""
    from tests.vectors.generate import ready_compact_full

    full = ready_compact_full()
    (record,) = _records(await run_node(node, "--dry-run", _description(tmp_path, _node_description(full))))
    value, headers = record
    assert dict(headers)["prm-schema-version"] == b"2"
    golden_twin = json.loads((VECTORS / "ready_compact.json").read_text())["value"]
    raw = msgspec.msgpack.decode(value)
    assert [(i.get("shared_messages", 0), i.get("shared_tokens", 0)) for i in raw["interactions"]] == [
        (i.get("shared_messages", 0), i.get("shared_tokens", 0)) for i in golden_twin["interactions"]
    ]
    assert decode_message(value, headers) == full


async def test_node_chunks_a_session_over_the_record_limit(node: str, tmp_path: Path) -> None:
    from infra.chunks import ChunkAssembler, reassembled
    from prm_pipeline.demo.synthetic import make_agent_session

    full = make_agent_session(
        trajectory_id="node-long/t0",
        session_id="node-long/s0",
        group_id="node-long",
        turns=12,
        context_tokens=6_000,
        output_tokens=50,
    )
    records = _records(
        await run_node(
            node, "--dry-run", "--max-message-bytes", "8192", _description(tmp_path, _node_description(full))
        )
    )
    assert len(records) > 2 and all(len(v) <= 8192 for v, _ in records)
    assembler: ChunkAssembler[int] = ChunkAssembler()
    done = []
    for offset, (value, headers) in enumerate(records):
        assert dict(headers) == {"prm-schema-version": b"2", "prm-kind": b"chunk"}
        done += assembler.add(0, decode_message(value, headers), offset)
    (whole,) = done
    assert reassembled(whole) == full


async def test_node_group_is_accepted_with_expected_rewards(
    node: str, cfg: PipelineConfig, workers, tmp_path: Path
) -> None:
    group = json.loads((PRODUCER / "example-group.json").read_text())
    gid = f"node-{uuid.uuid4().hex[:6]}"
    group["group_id"] = gid
    for i, session in enumerate(group["sessions"]):
        session["trajectory_id"] = f"{gid}/t{i}"
    out = await run_node(
        node,
        "--bootstrap",
        cfg.kafka.bootstrap,
        "--topic",
        cfg.topics.trajectories,
        "--compression",
        "gzip",
        _description(tmp_path, group),
    )
    assert json.loads(out) == {"published": 2, "group_id": gid, "topic": cfg.topics.trajectories}

    (verdict,) = [v for v in await wait_for_verdicts(cfg, [gid]) if v.group_id == gid]
    assert verdict.status == "accepted", verdict.reason
    assert verdict.group_size == 2
    two_turns, one_turn = sorted(verdict.sessions, key=lambda s: s.trajectory_id)
    assert (two_turns.outcome_reward, one_turn.outcome_reward) == (1.0, 0.0)
    # TokenParityScorer: +0.5 for even token ids, -0.25 for odd ones.
    rewards = {k: v.to_numpy().tolist() for k, v in two_turns.branches[0].token_rewards.items()}
    assert rewards == {"i0": [0.5, -0.25], "i1": [0.5, 0.5]}
    assert one_turn.branches[0].token_rewards["i0"].to_numpy().tolist() == [-0.25, -0.25, 0.5]
    # The child turn's prompt is its parent's input + output + the tool token 44 (concat export).
    assert two_turns.turns[1].parent_id == "i0"
    assert np.frombuffer(two_turns.turns[1].prompt_delta_raw, "<i4").tolist() == [44]


async def test_wrong_record_from_node_lands_in_dead_letters(
    node: str, cfg: PipelineConfig, workers, tmp_path: Path
) -> None:
    gid = f"node-bad-{uuid.uuid4().hex[:6]}"
    group = {
        "group_id": gid,
        "sessions": [
            {
                "trajectory_id": f"{gid}/t0",
                "outcome_reward": 1,
                "wire_mistake": "tokens_as_array",
                "interactions": [{"interaction_id": "i0", "input_tokens": [1, 2], "output_tokens": [3, 4]}],
            }
        ],
    }
    await run_node(
        node, "--bootstrap", cfg.kafka.bootstrap, "--topic", cfg.topics.trajectories, _description(tmp_path, group)
    )

    def found(records: list) -> bool:
        return any(r.key == gid.encode() for r in records)

    records = await read_topic(cfg, cfg.topics.dead_letters, until=time.monotonic() + 30, stop_when=found)
    (record,) = [r for r in records if r.key == gid.encode()]
    letter = dead_letter_from_record(record.value, record.headers)
    assert letter.error_class == "InvalidMessage"
    assert "Expected `bytes`, got `array`" in letter.error_message
    assert "interactions[0].model_response.output_tokens" in letter.error_message
    assert letter.original_headers == {"prm-schema-version": "1", "prm-kind": "ready"}
    assert msgspec.msgpack.decode(letter.payload)["group_id"] == gid  # the original bytes, kept
