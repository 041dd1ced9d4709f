"""A scripted LLM judge / teacher on loopback, for tests, benchmarks and demos.

Long on purpose: one self-contained test server speaking both judge APIs, with its scripting knobs.

:class:`FakeJudgeServer` is a real HTTP/1.1 server (stdlib
:class:`http.server.ThreadingHTTPServer` in a background thread, keep-alive on) that
answers the endpoints the judge scorers call:

``POST /v1/chat/completions``  OpenAI-compatible chat (the PRM judge and hint judge)
``POST /generate``             SGLang: ``{"text": ...}`` judges a rendered prompt;
                               ``{"input_ids": [...], "max_new_tokens": 0,
                               "return_logprob": true}`` is a teacher forward pass
``POST /tokenize``             vLLM-style chat tokenisation (``{"messages": [...],
                               "add_generation_prompt": true}`` -> ``{"tokens": [...]}``)
``GET  /health``               liveness

Verdicts are **scripted from the prompt**:

* PRM judge (any prompt not asking for hindsight hints): the next-state text decides —
  ``error``/``wrong`` (word prefix, case-insensitive) -> ``\\boxed{-1}``;
  ``thanks``/``ok``/``success`` -> ``\\boxed{1}``; otherwise ``\\boxed{0}``.
* Hint judge (the prompt mentions "hindsight hint extraction"): a negative next state
  -> ``\\boxed{1}`` plus a ``[HINT_START]...[HINT_END]`` block quoting it; otherwise
  ``\\boxed{-1}``.
* A marker ``[[votes: 1, -1, x, 500]]`` anywhere in the prompt scripts the votes for
  that exact prompt: the *k*-th request carrying it gets the *k*-th item — ``1``,
  ``0``, ``-1`` (or ``+1``) answer ``\\boxed{v}``; ``x`` answers text with no box;
  a 3-digit status (``500``, ``503``, ``429``, ``400``) answers that HTTP status;
  ``hang`` waits ``hang_s`` seconds first. Requests past the end reuse the last item.
* The teacher's log-prob of token ``t`` is :func:`fake_teacher_logprob` — it depends
  on whether the prompt (decoded from the fake tokenizer's ids, one id per character)
  carries the OPD hint header, so tests can tell a hinted teacher from a plain one.

``reasoning=True`` answers chat requests as a server with a reasoning parser does: the
whole judgement (box included) in ``message.reasoning_content``, ``content`` without a
box. :attr:`FakeJudgeServer.last_chat_payload` is the latest chat request's body.

Failure injection: ``latency_ms`` per request; ``error_rate`` (HTTP 500 with that
probability, seeded); ``outages`` (``(start_s, end_s)`` windows relative to
:meth:`FakeJudgeServer.start`) and :meth:`FakeJudgeServer.set_outage` — during an
outage requests get HTTP 503 (``outage_mode="503"``) or have their connection reset
without an answer (``outage_mode="reset"``); :meth:`FakeJudgeServer.fail_next` answers
the next *n* requests with a given status. Counters: :attr:`FakeJudgeServer.requests`,
:attr:`~FakeJudgeServer.by_path`, :attr:`~FakeJudgeServer.statuses`,
:attr:`~FakeJudgeServer.max_in_flight`, :attr:`~FakeJudgeServer.votes_served`.

It is a test and demo tool, not part of scoring. CLI: ``prm-pipeline fake-judge --port P
[--latency S] [--error-rate P] [--outage START:END ...]`` (or ``python -m
prm_pipeline.demo.fake_judge``) — see :func:`add_fake_judge_parser`.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from infra.ports import port_unavailable
from prm_pipeline.foreground import StopSignals
from scoring_workers.judge.prompts import HINT_SUFFIX_HEADER
from scoring_workers.scorers.conversation import render_chatml

__all__ = ["FakeJudgeServer", "add_fake_judge_parser", "cmd_fake_judge", "fake_teacher_logprob", "fake_tokenize"]

_NEG = re.compile(r"\b(error|wrong)", re.IGNORECASE)
_POS = re.compile(r"\b(thanks|thank you|ok\b|okay|success)", re.IGNORECASE)
_VOTES = re.compile(r"\[\[votes:\s*([^\]]*)\]\]", re.IGNORECASE)
_NEXT_STATE = re.compile(r"## Next state[^\n]*\n(.*?)(?:\n\n(?:First, classify|Now output|Now evaluate)|\Z)", re.DOTALL)
_HINT_PROMPT = "hindsight hint extraction"


def fake_tokenize(text: str) -> list[int]:
    """The fake tokenizer: one token per character, its code point."""
    return [ord(ch) for ch in text]


def fake_teacher_logprob(token_id: int, hinted: bool) -> float:
    """The fake teacher's log-prob of ``token_id`` (higher when the prompt has a hint)."""
    return (-0.25 if hinted else -2.0) - 0.05 * (int(token_id) % 4)


def _prm_reply(next_state: str) -> str:
    if _NEG.search(next_state):
        return "The next state reports a problem with the output, so it failed.\n\\boxed{-1}"
    if _POS.search(next_state):
        return "The next state confirms the task progressed as expected.\n\\boxed{1}"
    return "The next state is ambiguous.\n\\boxed{0}"


def _hint_reply(next_state: str) -> str:
    if _NEG.search(next_state):
        quoted = " ".join(next_state.split())[:160]
        return (
            "The next state reveals what went wrong.\n\\boxed{1}\n"
            f"[HINT_START]The environment answered: {quoted}. Check for this before answering.[HINT_END]"
        )
    return "Nothing in the next state would have improved the response.\n\\boxed{-1}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate writes: no 40 ms delayed-ACK stalls
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        return

    def setup(self) -> None:
        super().setup()
        self.server.owner._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._track(self.connection, False)

    def _send(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:  # the client gave up (timeout) and closed the connection
            self.close_connection = True

    def do_GET(self) -> None:
        if self.path.rstrip("/") in ("/health", "/healthz"):
            self._send(200, {"ok": True})
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        owner = self.server.owner
        owner._enter(self.path)
        status = 0
        try:
            status, body, headers = owner._respond(self.path, raw)
        finally:
            # Leave the in-flight count *before* answering: the client cannot have sent a
            # follow-up request yet, so max_in_flight never exceeds the client's concurrency.
            owner._exit(status)
        if status == -1:  # reset: drop the connection without an answer
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.close_connection = True
            return
        self._send(status, body, headers)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # the default backlog of 5 resets bursts of new connections
    owner: FakeJudgeServer


class FakeJudgeServer:
    """A scripted judge on ``host:port`` (port 0 picks a free one).

    ``FakeJudgeServer(...).start()`` returns the base URL; :meth:`stop` shuts it down
    (also usable as a context manager). All counters are thread-safe snapshots.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        latency_ms: float = 0.0,
        error_rate: float = 0.0,
        outages: Sequence[tuple[float, float]] = (),
        outage_mode: str = "503",
        hang_s: float = 30.0,
        seed: int | None = 0,
        model: str = "fake-judge",
        reasoning: bool = False,
    ) -> None:
        if latency_ms < 0 or not 0.0 <= error_rate <= 1.0:
            raise ValueError("latency_ms must be >= 0 and error_rate in [0, 1]")
        if outage_mode not in ("503", "reset"):
            raise ValueError(f"outage_mode must be '503' or 'reset', got {outage_mode!r}")
        for start, end in outages:
            if not 0 <= start < end:
                raise ValueError(f"outage window ({start}, {end}) must satisfy 0 <= start < end")
        self.host = host
        self.port = port
        self.latency_ms = float(latency_ms)
        self.error_rate = float(error_rate)
        self.outages = [(float(a), float(b)) for a, b in outages]
        self.outage_mode = outage_mode
        self.hang_s = float(hang_s)
        self.model = model
        self.reasoning = bool(reasoning)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._forced_outage = False
        self._fail_queue: list[tuple[int, float | None]] = []
        self._vote_counters: Counter[str] = Counter()
        self._started_at = 0.0
        self.requests = 0
        self.by_path: Counter[str] = Counter()
        self.statuses: Counter[int] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.votes_served: Counter[str] = Counter()
        """Answers by kind: ``prm``, ``hint``, ``teacher``, ``tokenize``, ``error``."""
        self.last_chat_payload: dict[str, Any] | None = None
        """The body of the latest ``/v1/chat/completions`` request (sampling parameters)."""

    # ------------------------------------------------------------------ lifecycle
    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeJudgeServer is not started")
        return f"http://{self.host}:{self._server.server_address[1]}"

    def start(self) -> str:
        """Bind, serve in a daemon thread, and return the base URL."""
        if self._server is not None:
            return self.base_url
        server = _Server((self.host, self.port), _Handler)
        server.owner = self
        self._server = server
        self._stopping.clear()
        self._started_at = time.monotonic()
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"fake-judge:{server.server_address[1]}",
            daemon=True,
        )
        self._thread.start()
        return self.base_url

    def stop(self) -> None:
        """Stop serving, wake sleeping handlers and close every connection."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()
        server.shutdown()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ control
    def set_outage(self, on: bool) -> None:
        """Force an outage on (every request fails per ``outage_mode``) or off."""
        with self._lock:
            self._forced_outage = bool(on)

    def fail_next(self, status: int, count: int = 1, *, retry_after: float | None = None) -> None:
        """Answer the next ``count`` requests with HTTP ``status`` (optionally ``Retry-After``)."""
        with self._lock:
            self._fail_queue.extend([(int(status), retry_after)] * count)

    def reset_counters(self) -> None:
        with self._lock:
            self.requests = 0
            self.by_path.clear()
            self.statuses.clear()
            self.max_in_flight = self.in_flight
            self.votes_served.clear()
            self._vote_counters.clear()

    def in_outage(self) -> bool:
        if self._forced_outage:
            return True
        elapsed = time.monotonic() - self._started_at
        return any(start <= elapsed < end for start, end in self.outages)

    # ------------------------------------------------------------------ handler side
    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            (self._conns.add if add else self._conns.discard)(conn)

    def _enter(self, path: str) -> None:
        with self._lock:
            self.requests += 1
            self.by_path[path] += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _exit(self, status: int) -> None:
        with self._lock:
            self.in_flight -= 1
            self.statuses[status] += 1

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._stopping.wait(seconds)

    def _respond(self, path: str, raw: bytes) -> tuple[int, Any, dict[str, str] | None]:
        with self._lock:
            forced = self._fail_queue.pop(0) if self._fail_queue else None
            outage = self.in_outage()
            error = self.error_rate > 0 and self._rng.random() < self.error_rate
        if outage:
            if self.outage_mode == "reset":
                return -1, None, None
            return 503, {"error": "judge outage"}, {"Retry-After": "0"}
        self._sleep(self.latency_ms / 1000.0)
        if forced is not None:
            status, retry_after = forced
            headers = {"Retry-After": f"{retry_after:g}"} if retry_after is not None else None
            return status, {"error": f"scripted HTTP {status}"}, headers
        if error:
            with self._lock:
                self.votes_served["error"] += 1
            return 500, {"error": "injected judge error"}, None
        try:
            payload = json.loads(raw or b"{}")
        except ValueError:
            return 400, {"error": "body is not JSON"}, None
        if not isinstance(payload, dict):
            return 400, {"error": "body must be a JSON object"}, None
        route = path.split("?", 1)[0].rstrip("/")
        if route in ("/v1/chat/completions", "/chat/completions"):
            messages = payload.get("messages")
            if not isinstance(messages, list) or not messages:
                return 400, {"error": "messages must be a non-empty list"}, None
            with self._lock:
                self.last_chat_payload = payload
            prompt = "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
            status, text = self._judge(prompt)
            if status != 200:
                return status, {"error": f"scripted HTTP {status}"}, None
            message = {"role": "assistant", "content": text}
            if self.reasoning:  # a server-side reasoning parser: the verdict is in the thinking only
                message = {"role": "assistant", "reasoning_content": text, "content": "My verdict is above."}
            return (
                200,
                {
                    "id": "fake-judge",
                    "object": "chat.completion",
                    "model": payload.get("model", self.model),
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                },
                None,
            )
        if route == "/generate":
            if "input_ids" in payload:
                return self._teacher(payload)
            text_in = payload.get("text")
            if not isinstance(text_in, str):
                return 400, {"error": "/generate needs 'text' or 'input_ids'"}, None
            status, text = self._judge(text_in)
            if status != 200:
                return status, {"error": f"scripted HTTP {status}"}, None
            return 200, {"text": text, "meta_info": {"finish_reason": {"type": "stop"}}}, None
        if route in ("/tokenize", "/v1/tokenize"):
            if isinstance(payload.get("messages"), list):
                text = render_chatml(payload["messages"], bool(payload.get("add_generation_prompt", True)))
            elif isinstance(payload.get("prompt"), str):
                text = payload["prompt"]
            else:
                return 400, {"error": "/tokenize needs 'messages' or 'prompt'"}, None
            tokens = fake_tokenize(text)
            with self._lock:
                self.votes_served["tokenize"] += 1
            return 200, {"tokens": tokens, "count": len(tokens), "max_model_len": 1 << 20}, None
        return 404, {"error": f"no route {path}"}, None

    def _judge(self, prompt: str) -> tuple[int, str]:
        marker = _VOTES.search(prompt)
        if marker:
            items = [item.strip().lower() for item in marker.group(1).split(",") if item.strip()]
            with self._lock:
                k = self._vote_counters[prompt]
                self._vote_counters[prompt] += 1
            item = items[min(k, len(items) - 1)] if items else "x"
            if item == "hang":
                self._sleep(self.hang_s)
                item = "0"
            if re.fullmatch(r"\d{3}", item):
                with self._lock:
                    self.votes_served["error"] += 1
                return int(item), ""
            with self._lock:
                self.votes_served["scripted"] += 1
            if item in ("1", "+1", "0", "-1"):
                return 200, f"Scripted vote {k}.\n\\boxed{{{item}}}"
            return 200, f"Scripted vote {k}: I cannot decide."
        found = _NEXT_STATE.search(prompt)
        next_state = found.group(1) if found else prompt
        kind = "hint" if _HINT_PROMPT in prompt else "prm"
        with self._lock:
            self.votes_served[kind] += 1
        return 200, (_hint_reply(next_state) if kind == "hint" else _prm_reply(next_state))

    def _teacher(self, payload: dict[str, Any]) -> tuple[int, Any, None]:
        ids = payload.get("input_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            return 400, {"error": "input_ids must be a list of ints"}, None
        sampling = payload.get("sampling_params") or {}
        if sampling.get("max_new_tokens", 0) != 0 or not payload.get("return_logprob"):
            return 400, {"error": "teacher forward needs max_new_tokens=0 and return_logprob=true"}, None
        start = int(payload.get("logprob_start_len", 0) or 0)
        if not 0 <= start <= len(ids):
            return 400, {"error": f"logprob_start_len {start} out of range"}, None
        text = "".join(chr(t) for t in ids if 0 <= t < 0x110000)
        hinted = HINT_SUFFIX_HEADER in text
        rows = [
            [None if i == 0 else fake_teacher_logprob(ids[i], hinted), ids[i], None] for i in range(start, len(ids))
        ]
        with self._lock:
            self.votes_served["teacher"] += 1
        return (
            200,
            {
                "text": "",
                "meta_info": {"prompt_tokens": len(ids), "completion_tokens": 0, "input_token_logprobs": rows},
            },
            None,
        )


# --------------------------------------------------------------------------- CLI
def _window(text: str) -> tuple[float, float]:
    try:
        start_s, end_s = text.split(":", 1)
        start, end = float(start_s), float(end_s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"outage window must be START:END in seconds, got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"outage window {text!r} must satisfy 0 <= START < END")
    return start, end


def _rate(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"error rate must be in [0, 1], got {text!r}")
    return value


def cmd_fake_judge(args: argparse.Namespace) -> int:
    """Serve the fake judge in the foreground until SIGINT/SIGTERM; exit code 0."""
    server = FakeJudgeServer(
        args.host,
        args.port,
        latency_ms=args.latency * 1000.0,
        error_rate=args.error_rate,
        outages=args.outage,
        outage_mode=args.outage_mode,
        seed=args.seed,
    )
    with StopSignals() as stop:
        try:
            url = server.start()
        except OSError as exc:  # one line naming the flag, exit 2 (prm_pipeline.cli)
            raise port_unavailable(exc, args.host, args.port, "fake-judge --port") from None
        print(f"PRM_JUDGE_URL={url}", flush=True)
        try:
            stop.wait()
        finally:
            server.stop()
            print(f"fake-judge: served {server.requests} requests {dict(server.statuses)}", flush=True)
    return 0


def add_fake_judge_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``fake-judge`` on an ``argparse`` subparsers object (``func`` = :func:`cmd_fake_judge`)."""
    p = subparsers.add_parser(
        "fake-judge",
        help="serve a scripted LLM judge / teacher on loopback (tests, benchmarks, demos)",
        description=(__doc__ or "").splitlines()[0],
    )
    from prm_pipeline.flags import deprecated_alias, port, seconds

    p.add_argument("--port", type=port, required=True, help="TCP port (0 picks a free one)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")

    latency = p.add_argument(
        "--latency", type=seconds, default=0.0, metavar="S", help="delay before every answer, in seconds"
    )
    deprecated_alias(
        p,
        "--latency-ms",
        latency,
        type=seconds,
        convert=lambda ms: ms / 1000.0,
        note=" (seconds; it took milliseconds)",
    )
    p.add_argument("--error-rate", type=_rate, default=0.0, help="fraction of requests answered HTTP 500")
    p.add_argument(
        "--outage",
        type=_window,
        action="append",
        default=[],
        metavar="START:END",
        help="outage window in seconds after start (repeatable)",
    )
    p.add_argument(
        "--outage-mode",
        choices=("503", "reset"),
        default="503",
        help="during an outage answer 503 or reset the connection",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the error injection")
    p.set_defaults(func=cmd_fake_judge)
    return p


if __name__ == "__main__":  # python -m prm_pipeline.demo.fake_judge --port 0
    import sys

    _parser = argparse.ArgumentParser(prog="fake-judge")
    _sub = _parser.add_subparsers(dest="command", required=True)
    add_fake_judge_parser(_sub)
    _args = _parser.parse_args(["fake-judge", *sys.argv[1:]])
    raise SystemExit(_args.func(_args))
