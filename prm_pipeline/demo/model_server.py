"""``prm-pipeline model-server``: the tiny policy behind SGLang's and OpenAI's HTTP APIs.

The OPD scorer needs a *real* teacher: log-probs of the rollout's own output tokens
under a model that read a hinted prompt. This server is that teacher for the demo and
the tests — the tiny LM of :mod:`prm_pipeline.demo.tiny_model` on loopback:

``POST /generate``              SGLang. ``{"input_ids": [...], "sampling_params":
                                {"max_new_tokens": 0}, "return_logprob": true,
                                "logprob_start_len": S}`` teacher-forces the ids and
                                answers ``meta_info.input_token_logprobs`` as
                                ``[logprob, id, null]`` rows from position ``S`` on
                                (``null`` at position 0, as SGLang). With
                                ``max_new_tokens > 0`` it samples (``input_ids`` or
                                ``text``) and answers ``text`` and ``output_ids``.
``POST /v1/chat/completions``   OpenAI chat: the demo template, then sampling.
``POST /tokenize``              vLLM's schema (``messages`` + ``add_generation_prompt``
                                -> ``tokens``): the OPD scorer's ``tokenizer: remote``,
                                so workers tokenise hinted prompts without
                                ``transformers``.
``GET  /health``                liveness, and the served ``policy_version``.

With ``--weights DIR`` it serves the newest weights published in that
:class:`~prm_pipeline.demo.tiny_model.WeightStore` (checked before each request); otherwise the
seeded initial weights. Requests are served one at a time (the model is small; a lock
keeps answers deterministic), on one torch thread.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from infra.ports import port_unavailable
from prm_pipeline.flags import port
from prm_pipeline.foreground import StopSignals

__all__ = ["ModelServer", "add_model_server_parser", "cmd_model_server"]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.rstrip("/") in ("/health", "/health_generate"):
            owner = self.server.owner
            self._send(200, {"status": "ok", "policy_version": owner.policy.version, "requests": owner.requests})
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            payload = json.loads(raw or b"{}")
            if not isinstance(payload, dict):
                raise ValueError("body must be a JSON object")
            status, body = self.server.owner.handle(self.path.split("?", 1)[0].rstrip("/"), payload)
        except (ValueError, TypeError, KeyError) as exc:
            status, body = 400, {"error": str(exc)}
        self._send(status, body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: ModelServer


class ModelServer:
    """The HTTP server around a :class:`~prm_pipeline.demo.tiny_model.TinyPolicy` (a background thread)."""

    def __init__(
        self,
        policy: Any = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        weights: str | None = None,
        seed: int = 0,
        max_new_tokens: int = 32,
    ) -> None:
        import torch

        from prm_pipeline.demo.tiny_model import TinyLMConfig, TinyPolicy, WeightStore

        self.policy = policy if policy is not None else TinyPolicy.create(TinyLMConfig(seed=seed))
        self.store = WeightStore(weights) if weights else None
        self.max_new_tokens = max_new_tokens
        self._generator = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()
        try:
            self._server = _Server((host, port), _Handler)
        except OSError as exc:  # one line naming the flag, exit 2 (prm_pipeline.cli), not a traceback
            raise port_unavailable(exc, host, port, "model-server --port") from None
        self._server.owner = self
        self._thread: threading.Thread | None = None
        self.requests = 0

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> str:
        self._thread = threading.Thread(target=self._server.serve_forever, name="model-server", daemon=True)
        self._thread.start()
        return self.base_url

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ routes
    def handle(self, route: str, payload: Mapping[str, Any]) -> tuple[int, Any]:
        with self._lock:
            self.requests += 1
            if self.store is not None:
                self.store.reload(self.policy)
            if route == "/generate":
                return self._generate(payload)
            if route in ("/v1/chat/completions", "/chat/completions"):
                return self._chat(payload)
            if route in ("/tokenize", "/v1/tokenize"):
                messages = payload.get("messages")
                if isinstance(messages, list):
                    ids = self.policy.template.render(messages, bool(payload.get("add_generation_prompt", True)))
                elif isinstance(payload.get("prompt"), str):
                    ids = self.policy.template.encode(payload["prompt"])
                else:
                    return 400, {"error": "/tokenize needs 'messages' or 'prompt'"}
                return 200, {"tokens": ids, "count": len(ids), "max_model_len": 2048}
            return 404, {"error": f"no route {route}"}

    def _ids(self, payload: Mapping[str, Any]) -> list[int]:
        if "input_ids" in payload:
            ids = payload["input_ids"]
            vocab = self.policy.tokenizer.get_vocab_size()
            if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"input_ids must be a list of ints in [0, {vocab})")
            return ids
        if isinstance(payload.get("text"), str):
            return self.policy.template.encode(payload["text"])
        raise ValueError("/generate needs 'input_ids' or 'text'")

    def _generate(self, payload: Mapping[str, Any]) -> tuple[int, Any]:
        ids = self._ids(payload)
        sampling = payload.get("sampling_params") or {}
        max_new = int(sampling.get("max_new_tokens", self.max_new_tokens))
        meta: dict[str, Any] = {"prompt_tokens": len(ids), "policy_version": self.policy.version}
        if max_new == 0:
            start = int(payload.get("logprob_start_len", 0) or 0)
            if not 0 <= start <= len(ids):
                return 400, {"error": f"logprob_start_len {start} out of range for {len(ids)} ids"}
            if payload.get("return_logprob"):
                lps = self.policy.prompt_logprobs(ids)
                meta["input_token_logprobs"] = [[lps[i], ids[i], None] for i in range(start, len(ids))]
            meta["completion_tokens"] = 0
            return 200, {"text": "", "output_ids": [], "meta_info": meta}
        sample = self.policy.sample(ids, min(max_new, 256), self._generator)
        meta.update(completion_tokens=len(sample.tokens), finish_reason={"type": sample.stop_reason})
        if payload.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(sample.tokens, sample.logprobs)]
        return 200, {"text": self.policy.template.decode(sample.tokens), "output_ids": sample.tokens, "meta_info": meta}

    def _chat(self, payload: Mapping[str, Any]) -> tuple[int, Any]:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return 400, {"error": "messages must be a non-empty list"}
        ids = self.policy.template.render(messages)
        max_new = int(payload.get("max_tokens") or self.max_new_tokens)
        sample = self.policy.sample(ids, min(max_new, 256), self._generator)
        text = self.policy.template.decode([t for t in sample.tokens if t > 2])
        return 200, {
            "id": "tiny-model",
            "object": "chat.completion",
            "model": payload.get("model", "tiny"),
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": sample.stop_reason}
            ],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(sample.tokens)},
        }


# --------------------------------------------------------------------------- CLI
def cmd_model_server(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; prints the base URL (port 0 picks a free one)."""
    import torch

    torch.set_num_threads(1)  # requests are served one at a time; leave the other cores to the workers
    with StopSignals() as stop:
        server = ModelServer(host=args.host, port=args.port, weights=args.weights, seed=args.seed)
        print(f"model-server listening on {server.start()}", flush=True)
        try:
            return stop.wait()
        finally:
            server.stop()


def add_model_server_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("model-server", help="serve the demo's tiny LM over SGLang /generate and OpenAI chat")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=0, help="0 = a free port (printed)")
    p.add_argument("--weights", default=None, help="a weight-store directory to follow (default: seeded init)")
    p.add_argument("--seed", type=int, default=0, help="model seed when no weights are published")
    p.set_defaults(func=cmd_model_server)
    return p
