"""``prm-pipeline inspect``: one verdict as the trainer will see it, token by token.

For each session of a group, each root-to-leaf branch is shown as its conversation:
prompt and environment tokens in grey, every **output token coloured by its process
reward** (the weighted sum the trainer folds into its advantages: green positive, red
negative, white zero), and under each turn the per-turn result of every scorer
(weighted reward and observations) plus, where a judge audit log is given, the judge's
votes with their texts (and the OPD hint).

Input is a verdict in the JSON-lines form of ``prm-pipeline verdicts --tokens`` (the
token-backed interactions, ``infra.jsonl.dump_verdict(v, include_tokens=True)``; the
demo writes ``demo-report/verdicts.jsonl``), or ``--group ID`` read from the verdicts
topic. Token ids are shown raw unless ``--tokenizer`` names the policy's
``tokenizer.json``: no verdict says which tokenizer produced its ids, and decoding with
the wrong one prints fluent nonsense. A group that is not accepted, and a member
without tokens (discarded, failed, missing), get one line each instead of a view.

(The module is ``token_view``, not ``inspect``, so it does not shadow the standard
library's :mod:`inspect`.)

Judge texts do not travel on verdicts (they can be long and are audit data): the judge
scorers hand them to an ``audit_sink``. :func:`record_judge_audit` is such a sink: it
appends one JSON line per record to ``$PRM_JUDGE_AUDIT_FILE`` (the demo sets it), and
``--audit FILE`` joins them back by trajectory, leaf and turn.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.errors import ConfigurationError
from infra.escape import printable, rich_text
from infra.schema import SchemaError

__all__ = [
    "BranchView",
    "TurnView",
    "branch_views",
    "cmd_inspect",
    "demo_decoder",
    "group_notes",
    "load_audit",
    "load_decoder",
    "raw_ids",
    "record_judge_audit",
    "render_html",
    "render_terminal",
    "verdict_record",
]

AUDIT_ENV = "PRM_JUDGE_AUDIT_FILE"


def record_judge_audit(record: Mapping[str, Any]) -> None:
    """``audit_sink`` for the judge scorers: append ``record`` to ``$PRM_JUDGE_AUDIT_FILE``.

    One ``write`` of one line on an ``O_APPEND`` file, so several worker processes can
    share the file without interleaving records.
    """
    path = os.environ.get(AUDIT_ENV)
    if not path:
        return
    line = (json.dumps(dict(record), ensure_ascii=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


AuditIndex = dict[tuple[str, str, str], list[dict[str, Any]]]


def load_audit(path: str | os.PathLike[str] | None) -> AuditIndex:
    """Audit records by ``(trajectory_id, leaf_id, interaction_id)``."""
    index: AuditIndex = {}
    if path is None or not Path(path).exists():
        return index
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            key = (str(rec.get("trajectory_id")), str(rec.get("leaf_id")), str(rec.get("interaction_id")))
            index.setdefault(key, []).append(rec)
    return index


@dataclass(slots=True)
class TurnView:
    interaction_id: str
    prompt_ids: list[int]  # tokens this turn adds before its output (the whole prompt at the root)
    output_ids: list[int]
    rewards: list[float]  # per output token, weighted sum over scorers
    results: list[dict[str, Any]]  # this branch's per-turn scorer results
    audit: list[dict[str, Any]]
    stop_reason: str | None = None


@dataclass(slots=True)
class BranchView:
    group_id: str
    session_id: str
    trajectory_id: str
    leaf_id: str
    outcome_reward: float | None
    policy_version: int | None
    turns: list[TurnView] = field(default_factory=list)
    session_branches: int = 1  # branches of its session: > 1 means the session forked

    @property
    def branching(self) -> bool:
        return self.session_branches > 1

    @property
    def policy(self) -> str:
        """``policy v3``; a trajectory published without a ``policy_version`` says so (not ``vNone``)."""
        return "policy version unknown" if self.policy_version is None else f"policy v{self.policy_version}"


def branch_views(verdict: Mapping[str, Any], audit: AuditIndex | None = None) -> list[BranchView]:
    """Every branch of every session of a verdict dict (with ``interactions``), in order."""
    audit = audit or {}
    views: list[BranchView] = []
    for s in verdict.get("sessions", []):
        inters = {i["interaction_id"]: i for i in s.get("interactions") or []}
        if not inters and s.get("status", "scored") != "scored":
            continue  # discarded / failed / missing: nothing scored to show (see group_notes)
        if not inters:
            raise SchemaError(
                f"group {verdict.get('group_id')!r}: session {s.get('session_id')!r} carries no token ids; "
                "write the verdict file with `prm-pipeline verdicts --tokens --out FILE`"
            )
        results = s.get("turn_results") or []
        pos = 0  # turn_results are flattened branch by branch, scorer by scorer (path order)
        for branch in s.get("branches", []):
            view = BranchView(
                verdict["group_id"],
                s["session_id"],
                s["trajectory_id"],
                branch["leaf_id"],
                s.get("outcome_reward"),
                s.get("policy_version"),
                session_branches=len(s.get("branches", [])),
            )
            block = results[pos : pos + len(branch["path"]) * len(branch.get("scorer_totals") or {})]
            pos += len(block)
            prev_len = 0
            for iid in branch["path"]:
                inter = inters[iid]
                inputs = inter["input_tokens"]
                outputs = inter["output_tokens"]
                rewards = branch["token_rewards"].get(iid) or [0.0] * len(outputs)
                view.turns.append(
                    TurnView(
                        iid,
                        inputs[prev_len:],
                        outputs,
                        [float(r) for r in rewards],
                        [r for r in block if r.get("interaction_id") == iid],
                        audit.get((s["trajectory_id"], branch["leaf_id"], iid), []),
                        inter.get("stop_reason"),
                    )
                )
                prev_len = len(inputs) + len(outputs)
            views.append(view)
    return views


def group_notes(verdict: Mapping[str, Any]) -> list[str]:
    """One line for a group that is not accepted, and one per member without tokens to show.

    A discarded group has no token view at all; saying so (with the discard reason)
    tells the reader the file was read, not that inspect silently skipped it.
    """
    status = verdict.get("status", "accepted")
    sessions = verdict.get("sessions") or []
    notes = []
    if status != "accepted":
        reason = f" ({verdict.get('reason')})" if verdict.get("reason") else ""
        notes.append(
            f"group {verdict.get('group_id')}: {status}{reason}; {len(sessions)} of "
            f"{verdict.get('group_size', len(sessions))} members listed"
        )
    for s in sessions:
        if not s.get("interactions") and s.get("status", "scored") != "scored":
            error = f": {s['error']}" if s.get("error") else ""
            notes.append(
                f"  session {s.get('session_id')} (trajectory {s.get('trajectory_id')}): "
                f"{s.get('status')}{error}; no token view"
            )
    return notes


def verdict_record(verdict: Any) -> dict[str, Any]:
    """A :class:`~infra.schema.GroupVerdict` as inspect's input: the verdict JSON line with
    token-backed interactions, plus each session's ``policy_version``."""
    from infra.jsonl import dump_verdict

    record = dump_verdict(verdict, include_tokens=True)
    for entry, session in zip(record["sessions"], verdict.sessions):
        entry["policy_version"] = session.policy_version
    return record


Decoder = Callable[[Sequence[int]], list[str]]


def raw_ids(ids: Sequence[int]) -> list[str]:
    """The raw-ids view: each token as ``[id]``. The default, because no file says which
    tokenizer produced its ids, and decoding with the wrong one prints fluent nonsense."""
    return [f"[{int(i)}]" for i in ids]


DEMO_TOKENIZER = "prm_pipeline.demo.tiny_model:build_tokenizer"  # resolved only for --tokenizer demo


def demo_decoder() -> Decoder:
    """Token ids -> per-token strings with the demo's tiny tokenizer (needs the ``demo`` extra).

    The demo is a development package: ``inspect`` names its tokenizer by path and imports it
    only here, so the product never imports ``prm_pipeline.demo``."""
    import importlib

    module, _, name = DEMO_TOKENIZER.partition(":")
    build_tokenizer = getattr(importlib.import_module(module), name)
    return _token_decoder(build_tokenizer(), "the demo tokenizer")


class TokenizerError(ConfigurationError, ValueError):
    """A ``--tokenizer`` that cannot be loaded."""


def load_decoder(spec: str) -> Decoder:
    """``--tokenizer``: a ``tokenizer.json`` (or a folder holding one), or ``demo``.

    Ids outside the tokenizer's vocabulary are shown as ``[id?]`` and reported once on
    stderr: a sign that the file was not produced with this tokenizer.
    """
    if spec == "demo":
        try:
            return demo_decoder()
        except ImportError as exc:
            raise TokenizerError(f"--tokenizer demo needs the demo extra ({exc})") from None
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"--tokenizer {spec}: no such file (give a tokenizer.json, a folder holding one, or 'demo')"
        )
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError("--tokenizer needs the 'tokenizers' package (pip install tokenizers)") from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the library raises plain Exceptions for bad files
        raise TokenizerError(f"--tokenizer {path}: not a tokenizer.json ({str(exc).splitlines()[0][:200]})") from None
    return _token_decoder(tok, str(path))


def _token_decoder(tok: Any, name: str) -> Decoder:
    size = tok.get_vocab_size(with_added_tokens=True)
    warned: list[bool] = []

    def decode(ids: Sequence[int]) -> list[str]:
        out = []
        for i in ids:
            i = int(i)
            if 0 <= i < size:
                out.append(tok.decode([i], skip_special_tokens=False))
                continue
            out.append(f"[{i}?]")
            if not warned:
                warned.append(True)
                print(
                    f"inspect: token id {i} is outside {name}'s vocabulary ({size} ids); was this file produced "
                    "with another tokenizer? (shown as [id?])",
                    file=sys.stderr,
                )
        return out

    return decode


def _colour(r: float, scale: float) -> str:
    a = min(1.0, abs(r) / scale) if scale > 0 else 0.0
    rgb = (46, 160, 67) if r > 0 else (218, 54, 51)
    return f"rgba({rgb[0]},{rgb[1]},{rgb[2]},{0.15 + 0.75 * a:.2f})" if r != 0 else "transparent"


def _obs_text(result: Mapping[str, Any]) -> str:
    parts = []
    for o in result.get("observations") or []:
        v = o.get("value")
        parts.append(f"{o.get('metric_id')}={v:.3g}" if isinstance(v, float) else f"{o.get('metric_id')}={v}")
    return ", ".join(parts)


def _esc(text: str) -> str:
    return html.escape(text).replace("\n", "\u21b5<br>")


def render_html(views: Iterable[BranchView], decode: Callable[[Sequence[int]], list[str]] | None = None) -> str:
    """An HTML fragment (inline styles only) with one block per branch."""
    decode = decode or raw_ids
    out = ['<div class="token-views">']
    for v in views:
        scale = max((abs(r) for t in v.turns for r in t.rewards), default=0.0) or 1.0
        out.append(
            f'<div class="branch" style="border:1px solid #ccc;border-radius:6px;padding:8px;margin:10px 0">'
            f'<div style="font-weight:bold">group {html.escape(v.group_id)} · session {html.escape(v.session_id)}'
            f" · leaf {html.escape(v.leaf_id)}{' · branching session' if v.branching else ''}"
            f" · outcome reward {v.outcome_reward} · {v.policy}</div>"
        )
        for t in v.turns:
            prompt = "".join(_esc(s) for s in decode(t.prompt_ids))
            toks = []
            for tok, r in zip(decode(t.output_ids), t.rewards):
                toks.append(f'<span title="reward {r:+.4f}" style="background:{_colour(r, scale)}">{_esc(tok)}</span>')
            out.append(
                f'<div class="turn" style="margin:6px 0"><div style="color:#888;font-family:monospace;'
                f'font-size:12px">{prompt}</div><div style="font-family:monospace;font-size:13px">'
                f"<b>{html.escape(t.interaction_id)}</b> ({len(t.output_ids)} tokens, {t.stop_reason}): "
                f"{''.join(toks)}</div>"
            )
            rows = [
                f"<tr><td>{html.escape(str(r.get('scorer_name')))}</td><td>{float(r.get('reward', 0)):+.4f}</td>"
                f"<td>{html.escape(_obs_text(r))}</td></tr>"
                for r in t.results
            ]
            for a in t.audit:
                texts = " | ".join(f"{k}: {a[k]}" for k in sorted(a) if k.startswith("vote_"))
                extra = f" hint: {a['hint']}" if a.get("hint") else ""
                rows.append(
                    f"<tr><td>{html.escape(str(a.get('scorer')))} votes</td>"
                    f"<td>{html.escape(str(a.get('votes', '')))}</td>"
                    f"<td style='font-size:11px'>{html.escape(texts + extra)}</td></tr>"
                )
            if rows:
                out.append(
                    '<table class="turn-results" style="font-size:12px;border-collapse:collapse;'
                    'margin-left:12px"><tr><th>scorer</th><th>turn reward</th><th>details</th></tr>'
                    + "".join(rows)
                    + "</table>"
                )
            out.append("</div>")
        out.append("</div>")
    out.append("</div>")
    return "\n".join(out)


def render_terminal(
    views: Iterable[BranchView], decode: Callable[[Sequence[int]], list[str]] | None = None, *, console: Any = None
) -> None:
    """The same view with ``rich``: output tokens on a green/red background by reward.

    Everything shown is the verdict's (and the model's) text: it reaches rich escaped and as
    :class:`rich.text.Text`, never as markup (:mod:`infra.escape`)."""
    from rich.console import Console
    from rich.table import Table

    decode = decode or raw_ids
    console = console or Console()
    for v in views:
        scale = max((abs(r) for t in v.turns for r in t.rewards), default=0.0) or 1.0
        console.rule(
            rich_text(
                f"{v.group_id} · {v.session_id} · leaf {v.leaf_id} · outcome {v.outcome_reward} · "
                f"{v.policy}{' · branching' if v.branching else ''}"
            )
        )
        for t in v.turns:
            text = rich_text("".join(decode(t.prompt_ids)), style="dim", multiline=True)
            text.append(f"\n[{printable(t.interaction_id)}] ", style="bold")
            for tok, r in zip(decode(t.output_ids), t.rewards):
                a = min(1.0, abs(r) / scale)
                level = int(40 + 140 * a)
                style = "" if r == 0 else (f"on rgb(0,{level},0)" if r > 0 else f"on rgb({level},0,0)")
                text.append(printable(tok, multiline=True), style=style)
            console.print(text)
            table = Table("scorer", "turn reward", "details", show_edge=False, pad_edge=False)
            for res in t.results:
                table.add_row(
                    rich_text(str(res.get("scorer_name"))),
                    f"{float(res.get('reward', 0)):+.4f}",
                    rich_text(_obs_text(res)),
                )
            for entry in t.audit:
                texts = " | ".join(f"{k}: {entry[k]}" for k in sorted(entry) if k.startswith("vote_"))
                table.add_row(
                    rich_text(f"{entry.get('scorer')} votes"),
                    rich_text(str(entry.get("votes", ""))),
                    rich_text(texts + (f" hint: {entry['hint']}" if entry.get("hint") else "")),
                )
            if table.row_count:
                console.print(table)


# --------------------------------------------------------------------------- CLI
def _verdicts_from_file(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


async def _verdict_from_topic(args: argparse.Namespace) -> dict[str, Any] | None:
    from infra.config import load_config
    from infra.readback import VerdictTokens
    from prm_pipeline.observe import VerdictTail

    cfg = load_config(args.config)
    tail = VerdictTail(cfg, experiment=getattr(args, "experiment", None) or cfg.trainer.experiment)
    await tail.start()
    try:
        await tail.wait_for({args.group}, timeout_s=args.wait)
    except TimeoutError:
        return None
    finally:
        await tail.aclose()
    tokens = VerdictTokens(cfg)  # a verdict published with worker.verdict_tokens: reference
    try:
        verdict = await tokens.resolve_one(tail.verdicts[args.group])
    finally:
        await tokens.aclose()
    return verdict_record(verdict)


async def _open_group_state(args: argparse.Namespace) -> str:
    """``"; it is open: …"`` when the ledger holds the group undecided (what ``status`` reads), so
    "no verdict" is not taken for "lost"; "" when Redis does not know it (or cannot be asked)."""
    from infra.config import load_config
    from infra.experiments import scoped_group
    from scoring_workers.ledger import LedgerView

    cfg = load_config(args.config)
    view = LedgerView.from_config(cfg.redis)
    try:
        state = await asyncio.wait_for(
            view.group_state(scoped_group(getattr(args, "experiment", None) or cfg.trainer.experiment, args.group)),
            timeout=5.0,
        )
    except Exception:  # noqa: BLE001 - advice only: without Redis the plain "no verdict" stands
        return ""
    finally:
        await view.aclose()
    if state is None:
        return ""
    if state.status != "open":
        return f"; the ledger holds it {state.status}: its verdict is being published"
    left = max(0.0, state.deadline_ms / 1000 - time.time())
    return (
        f"; it is open: {state.parked} of {state.group_size} members parked, decided when the rest arrive "
        f"or in {left:.0f} s (its deadline)"
    )


def cmd_inspect(args: argparse.Namespace) -> int:
    if not args.verdicts and not args.group:
        print("inspect: give --group ID (read from the verdicts topic) and/or --verdicts FILE", file=sys.stderr)
        return 2
    tokenizer = getattr(args, "tokenizer", None)
    try:
        decode = load_decoder(tokenizer) if tokenizer and not getattr(args, "ids", False) else raw_ids
    except TokenizerError as exc:
        print(f"inspect: {exc}", file=sys.stderr)
        return 2
    if args.verdicts:
        verdicts = _verdicts_from_file(args.verdicts)
        if args.group:
            verdicts = [v for v in verdicts if v.get("group_id") == args.group]
        if getattr(args, "experiment", None):  # a file may hold several experiments' verdicts
            verdicts = [v for v in verdicts if v.get("experiment_id", "default") == args.experiment]
    else:
        found = asyncio.run(_verdict_from_topic(args))
        verdicts = [found] if found else []
    if not verdicts:
        state = "" if args.verdicts else asyncio.run(_open_group_state(args))
        print(f"inspect: no verdict for group {args.group!r}{state}", file=sys.stderr)
        return 1
    if args.session:  # filter first: the session may be in any group of the file, not only the first few
        read = len(verdicts)
        verdicts = [v for v in verdicts if any(s.get("session_id") == args.session for s in v.get("sessions") or ())]
        if not verdicts:
            where = args.verdicts or f"the verdict of group {args.group!r}"
            print(
                f"inspect: no session {args.session!r} in {where} ({read} verdict(s) read"
                f"{', group ' + repr(args.group) if args.group and args.verdicts else ''})",
                file=sys.stderr,
            )
            return 1
    audit = load_audit(args.audit)
    shown = verdicts[: args.max_groups]
    try:
        views = [view for v in shown for view in branch_views(v, audit)]
    except ValueError as exc:
        print(printable(f"inspect: {exc}"), file=sys.stderr)
        return 1
    if args.session:
        views = [v for v in views if v.session_id == args.session]
    notes = [line for v in shown for line in group_notes(v)]
    for line in notes:
        print(printable(line))
    if decode is raw_ids and views:
        print(
            "inspect: token ids shown raw; --tokenizer FILE (the policy's tokenizer.json, or 'demo' for the "
            "demo's model) decodes them",
            file=sys.stderr,
        )
    if not args.no_terminal:
        render_terminal(views, decode)
    if args.html:
        body = render_html(views, decode)
        extra = "".join(f"<p class='group-note'>{html.escape(line)}</p>" for line in notes)
        Path(args.html).write_text(
            f"<!doctype html><html><head><meta charset='utf-8'><title>prm-pipeline inspect"
            f"</title></head><body>{extra}{body}</body></html>"
        )
        print(f"token view written to {Path(args.html).resolve()}")
    return 0


def inspect_arguments(p: argparse.ArgumentParser) -> None:
    """``prm-pipeline inspect``'s flags (the command is described in prm_pipeline.cli.COMMANDS)."""
    from prm_pipeline.flags import deprecated_alias, seconds

    p.add_argument("--group", help="this group's verdict: from the verdicts topic, or picked from --verdicts")
    p.add_argument("--verdicts", help="a JSON-lines verdict file with token ids (prm-pipeline verdicts --tokens)")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="FILE",
        help="decode token ids with this tokenizer.json (or a folder holding one; 'demo' = the demo's "
        "model); default: show raw ids",
    )
    p.add_argument("--ids", action="store_true", help="show raw token ids even with --tokenizer")
    p.add_argument("--audit", default=None, help="judge audit JSON lines (record_judge_audit) to show votes and texts")
    p.add_argument(
        "--session", default=None, help="only this session, looked for in every group read (exit 1 when none holds it)"
    )
    p.add_argument(
        "--max-groups",
        type=int,
        default=3,
        help="groups shown from a --verdicts file, after --group/--session/--experiment (default 3)",
    )
    p.add_argument("--html", default=None, help="also write the token view as a self-contained HTML file")
    p.add_argument("--no-terminal", action="store_true", help="no terminal view")
    wait = p.add_argument(
        "--wait", type=seconds, default=30.0, metavar="S", help="--group: seconds to wait for the verdict (default 30)"
    )
    deprecated_alias(p, "--timeout", wait)
    from prm_pipeline.experiment_option import add_experiment_option

    add_experiment_option(
        p,
        "--group: read this experiment's verdicts topic (default: trainer.experiment); "
        "--verdicts: only this experiment's lines",
    )
