#!/usr/bin/env node
// Publishes one GRPO group to prm-pipeline's trajectories topic from a JSON description.
//
// Written from docs/wire.md alone (no code of the pipeline): every session becomes one
// `ready` record (a msgpack map), token ids are packed little-endian int32 and log-probs
// little-endian float32 into msgpack `bin`, the record key is the group id, and the two
// headers carry the schema version and the kind.
//
//   node produce.js --bootstrap 127.0.0.1:9092 [--topic prm.trajectories] [--compression none|gzip] group.json
//   node produce.js --dry-run group.json      # print the encoded records as hex instead of publishing
//
// The description (see README.md):
//   {"group_id": "g1", "group_size": 2,            // group_size defaults to the number of sessions
//    "sessions": [{"trajectory_id": "t1", "session_id": "s1", "outcome_reward": 1.0,
//                  "is_eval": false, "policy_version": 3, "created_at": 1764500000.0,
//                  "interactions": [{"interaction_id": "i0", "parent_id": null,
//                                    "messages": [...], "output_message_list": [...],
//                                    "input_tokens": [1, 2], "output_tokens": [3, 4],
//                                    "output_logprobs": [-0.5, -0.25], "stop_reason": "stop"}]}],
//    "discard": null}                               // or {"reason": "..."} to publish a discard after the sessions
//
// A session may set "wire_mistake": "tokens_as_array" to send its output tokens as a
// msgpack array instead of packed bytes: a record the workers must dead-letter.
"use strict";

const fs = require("fs");
const { encode } = require("@msgpack/msgpack");
const { Kafka, CompressionTypes, logLevel } = require("kafkajs");

const SCHEMA_VERSION = "1";

function packInt32(values) {
  const out = new Uint8Array(4 * values.length);
  const view = new DataView(out.buffer);
  values.forEach((v, i) => {
    if (!Number.isInteger(v) || v < -2147483648 || v > 2147483647) throw new Error(`token id ${v} is not an int32`);
    view.setInt32(4 * i, v, true); // little-endian
  });
  return out;
}

function packFloat32(values) {
  const out = new Uint8Array(4 * values.length);
  const view = new DataView(out.buffer);
  values.forEach((v, i) => view.setFloat32(4 * i, v, true)); // little-endian
  return out;
}

function interaction(it, mistake) {
  const response = {
    input_tokens: packInt32(it.input_tokens),
    output_tokens: mistake === "tokens_as_array" ? it.output_tokens : packInt32(it.output_tokens),
  };
  if (it.output_logprobs != null) response.output_logprobs = packFloat32(it.output_logprobs);
  if (it.stop_reason != null) response.stop_reason = it.stop_reason;
  const out = { interaction_id: it.interaction_id };
  if (it.parent_id != null) out.parent_id = it.parent_id;
  if (it.messages) out.messages = it.messages;
  if (it.output_message_list) out.output_message_list = it.output_message_list;
  if (it.reward != null) out.reward = it.reward;
  out.model_response = response;
  return out;
}

function readyRecord(group, session, groupSize) {
  const value = {
    kind: "ready",
    trajectory_id: session.trajectory_id,
    session_id: session.session_id || session.trajectory_id,
    group_id: group.group_id,
    group_size: groupSize,
    interactions: session.interactions.map((it, k) => interaction(it, k === 0 ? session.wire_mistake : undefined)),
    outcome_reward: session.outcome_reward,
  };
  if (session.is_eval != null) value.is_eval = session.is_eval;
  if (session.policy_version != null) value.policy_version = session.policy_version;
  value.created_at = session.created_at != null ? session.created_at : Date.now() / 1000;
  return { kind: "ready", value };
}

function records(group) {
  if (!group.group_id) throw new Error("the description needs a group_id");
  const sessions = group.sessions || [];
  const groupSize = group.group_size || sessions.length;
  const out = sessions.map((s) => readyRecord(group, s, groupSize));
  if (group.discard) {
    out.push({ kind: "discard",
      value: { kind: "discard", group_id: group.group_id, reason: group.discard.reason || "", requested_at: Date.now() / 1000 } });
  }
  return out.map(({ kind, value }) => ({
    key: group.group_id,
    value: Buffer.from(encode(value)),
    headers: { "prm-schema-version": SCHEMA_VERSION, "prm-kind": kind },
  }));
}

function parseArgs(argv) {
  const args = { topic: "prm.trajectories", compression: "none", dryRun: false, file: null, bootstrap: null };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--bootstrap") args.bootstrap = argv[++i];
    else if (a === "--topic") args.topic = argv[++i];
    else if (a === "--compression") args.compression = argv[++i];
    else if (a === "--dry-run") args.dryRun = true;
    else if (!a.startsWith("--")) args.file = a;
    else throw new Error(`unknown option ${a}`);
  }
  if (!args.file) throw new Error("usage: produce.js [--bootstrap HOST:PORT] [--topic T] [--compression none|gzip] [--dry-run] group.json");
  if (!["none", "gzip"].includes(args.compression)) throw new Error("--compression must be none or gzip");
  return args;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const group = JSON.parse(fs.readFileSync(args.file, "utf8"));
  const messages = records(group);
  if (args.dryRun) {
    for (const m of messages) console.log(JSON.stringify({ key: m.key, headers: m.headers, value_hex: m.value.toString("hex") }));
    return;
  }
  if (!args.bootstrap) throw new Error("--bootstrap is required to publish");
  const kafka = new Kafka({ clientId: "prm-node-producer", brokers: args.bootstrap.split(","), logLevel: logLevel.WARN });
  const producer = kafka.producer({ allowAutoTopicCreation: false });
  await producer.connect();
  try {
    await producer.send({
      topic: args.topic,
      acks: -1, // all in-sync replicas: the record is durable when send resolves
      compression: args.compression === "gzip" ? CompressionTypes.GZIP : CompressionTypes.None,
      messages,
    });
  } finally {
    await producer.disconnect();
  }
  console.log(JSON.stringify({ published: messages.length, group_id: group.group_id, topic: args.topic }));
}

main().catch((err) => {
  console.error(`produce.js: ${err.message}`);
  process.exit(1);
});
