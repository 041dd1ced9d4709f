#!/usr/bin/env node
// Publishes one GRPO group to prm-pipeline's trajectories topic from a JSON description.
//
// Written from docs/wire.md alone (no code of the pipeline): every session becomes one
// `ready` record (a msgpack map), token ids are packed little-endian int32 and log-probs
// little-endian float32 into msgpack `bin`, the record key is the group id, and the two
// headers carry the schema version and the kind. Sessions are sent in the compact form
// (each turn carries only what follows the prefix it shares with its parent's context;
// schema version 2 when any turn shares something), and a record over
// --max-message-bytes is split into `chunk` records.
//
//   node produce.js --bootstrap 127.0.0.1:9092 [--topic prm.trajectories] [--compression none|gzip]
//                   [--max-message-bytes 1048576] [--full-form] group.json
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

const FULL_FORM_VERSION = "1"; // every record version 1 can express
const COMPACT_VERSION = "2"; // compact `ready` records (a turn with shared_*) and `chunk` records
const MAX_CHUNKS = 256;
const CHUNK_OVERHEAD = 512; // bytes of a chunk record besides its data: fields, key, headers, framing

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

// How many leading items of `items` equal `context` (the parent's items + its outputs).
function sharedPrefix(items, context, same) {
  let k = 0;
  while (k < items.length && k < context.length && same(items[k], context[k])) k++;
  return k;
}

const sameMessage = (a, b) => a === b || JSON.stringify(a) === JSON.stringify(b);

// The compact form (docs/wire.md, "Compact form"): per turn, the longest prefix it shares
// with its parent's context (messages + output messages; prompt + output tokens).
function sharing(interactions, fullForm) {
  const byId = new Map(interactions.map((it) => [it.interaction_id, it]));
  return interactions.map((it) => {
    const parent = it.parent_id != null ? byId.get(it.parent_id) : undefined;
    if (fullForm || !parent) return { messages: 0, tokens: 0 };
    const messages = sharedPrefix(it.messages || [],
      [...(parent.messages || []), ...(parent.output_message_list || [])], sameMessage);
    const tokens = sharedPrefix(it.input_tokens, [...parent.input_tokens, ...parent.output_tokens], (a, b) => a === b);
    return { messages, tokens };
  });
}

function interaction(it, mistake, shared) {
  const response = {
    input_tokens: packInt32(it.input_tokens.slice(shared.tokens)),
    output_tokens: mistake === "tokens_as_array" ? it.output_tokens : packInt32(it.output_tokens),
  };
  if (it.output_logprobs != null) response.output_logprobs = packFloat32(it.output_logprobs);
  if (it.stop_reason != null) response.stop_reason = it.stop_reason;
  const out = { interaction_id: it.interaction_id };
  if (it.parent_id != null) out.parent_id = it.parent_id;
  if (it.messages) out.messages = it.messages.slice(shared.messages);
  if (it.output_message_list) out.output_message_list = it.output_message_list;
  if (it.reward != null) out.reward = it.reward;
  out.model_response = response;
  if (shared.messages) out.shared_messages = shared.messages; // left out at 0, as our writer does
  if (shared.tokens) out.shared_tokens = shared.tokens;
  return out;
}

function readyRecord(group, session, groupSize, fullForm) {
  const shared = sharing(session.interactions, fullForm);
  const value = {
    kind: "ready",
    trajectory_id: session.trajectory_id,
    session_id: session.session_id || session.trajectory_id,
    group_id: group.group_id,
    group_size: groupSize,
    interactions: session.interactions.map((it, k) => interaction(it, k === 0 ? session.wire_mistake : undefined,
      shared[k])),
    outcome_reward: session.outcome_reward,
  };
  if (session.is_eval != null) value.is_eval = session.is_eval;
  if (session.policy_version != null) value.policy_version = session.policy_version;
  value.created_at = session.created_at != null ? session.created_at : Date.now() / 1000;
  const compact = shared.some((s) => s.messages || s.tokens);
  return { kind: "ready", version: compact ? COMPACT_VERSION : FULL_FORM_VERSION, value };
}

// A `ready` value too large for one record becomes `count` chunk records (docs/wire.md, "chunk").
function chunked(group, session, bytes, maxMessageBytes) {
  const budget = maxMessageBytes - CHUNK_OVERHEAD - Buffer.byteLength(group.group_id) - 2 * Buffer.byteLength(session.trajectory_id);
  const count = Math.max(2, Math.ceil(bytes.length / budget));
  if (budget <= 0 || count > MAX_CHUNKS) {
    throw new Error(`session ${JSON.stringify(session.trajectory_id)} is ${bytes.length} bytes in compact form over ` +
      `${session.interactions.length} turns: more than ${MAX_CHUNKS} records of --max-message-bytes ${maxMessageBytes}`);
  }
  const size = Math.ceil(bytes.length / count);
  const out = [];
  for (let index = 0; index < count; index++) {
    out.push({ kind: "chunk", version: COMPACT_VERSION, value: {
      kind: "chunk", group_id: group.group_id, trajectory_id: session.trajectory_id, index, count,
      total_bytes: bytes.length, data: bytes.subarray(index * size, (index + 1) * size),
    } });
  }
  return out;
}

function records(group, { maxMessageBytes = 1048576, fullForm = false } = {}) {
  if (!group.group_id) throw new Error("the description needs a group_id");
  const sessions = group.sessions || [];
  const groupSize = group.group_size || sessions.length;
  const out = [];
  for (const s of sessions) {
    const ready = readyRecord(group, s, groupSize, fullForm);
    const bytes = encode(ready.value);
    if (bytes.length + CHUNK_OVERHEAD <= maxMessageBytes) out.push({ ...ready, bytes });
    else out.push(...chunked(group, s, bytes, maxMessageBytes));
  }
  if (group.discard) {
    out.push({ kind: "discard", version: FULL_FORM_VERSION,
      value: { kind: "discard", group_id: group.group_id, reason: group.discard.reason || "", requested_at: Date.now() / 1000 } });
  }
  return out.map(({ kind, version, value, bytes }) => ({
    key: group.group_id,
    value: Buffer.from(bytes || encode(value)),
    headers: { "prm-schema-version": version, "prm-kind": kind },
  }));
}

function parseArgs(argv) {
  const args = { topic: "prm.trajectories", compression: "none", dryRun: false, file: null, bootstrap: null,
    maxMessageBytes: 1048576, fullForm: false };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--bootstrap") args.bootstrap = argv[++i];
    else if (a === "--topic") args.topic = argv[++i];
    else if (a === "--compression") args.compression = argv[++i];
    else if (a === "--dry-run") args.dryRun = true;
    else if (a === "--max-message-bytes") args.maxMessageBytes = Number(argv[++i]);
    else if (a === "--full-form") args.fullForm = true;
    else if (!a.startsWith("--")) args.file = a;
    else throw new Error(`unknown option ${a}`);
  }
  if (!args.file) {
    throw new Error("usage: produce.js [--bootstrap HOST:PORT] [--topic T] [--compression none|gzip] " +
      "[--max-message-bytes N] [--full-form] [--dry-run] group.json");
  }
  if (!Number.isInteger(args.maxMessageBytes) || args.maxMessageBytes < 1024) throw new Error("--max-message-bytes must be an integer >= 1024");
  if (!["none", "gzip"].includes(args.compression)) throw new Error("--compression must be none or gzip");
  return args;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const group = JSON.parse(fs.readFileSync(args.file, "utf8"));
  const messages = records(group, { maxMessageBytes: args.maxMessageBytes, fullForm: args.fullForm });
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
