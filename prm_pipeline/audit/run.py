"""Running one audit end to end: :class:`AuditOptions`, :func:`audit`, :func:`run_audit`.

:func:`audit` wires the parts together: builds the runners
(:mod:`~prm_pipeline.audit.rescoring`), reads the verdicts then the trajectories
topic (:mod:`~prm_pipeline.audit.replay`) into an
:class:`~prm_pipeline.audit.auditor.Auditor`, and writes ``--out`` and the summary
(:mod:`~prm_pipeline.audit.report`). :func:`run_audit` is its synchronous entry
point with the command's exit codes.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from infra.config import PipelineConfig, PRMConfig
from infra.experiments import DEFAULT_EXPERIMENT, trajectories_topic, verdicts_topic
from infra.readback import VerdictTokens, needs_tokens
from infra.schema import GroupVerdict
from prm_pipeline.audit.auditor import Auditor, AuditReport
from prm_pipeline.audit.compare import DEFAULT_TOLERANCE, Tolerance
from prm_pipeline.audit.replay import AuditError, read_snapshot
from prm_pipeline.audit.report import _progress, render_summary, write_findings
from prm_pipeline.audit.rescoring import build_runners
from scoring_workers.judge.hosts import judge_hosts_allowed


# =========================================================================== running it
@dataclass
class AuditOptions:
    """Options of one audit (the CLI flags; see :func:`add_audit_parser`)."""

    since_ms: int | None = None
    from_offsets: Mapping[str, Mapping[int, int]] | None = None
    groups: Sequence[str] | None = None
    out: str | None = None
    tolerance: Tolerance = DEFAULT_TOLERANCE
    concurrency: int = 16
    timeout_s: float | None = None  # default: worker.scorer_timeout_s
    max_differences: int = 100
    progress: bool | None = None  # None: when stderr is a terminal
    show: int = 10  # differing groups listed in the summary
    experiment: str = DEFAULT_EXPERIMENT  # whose topics are read and whose records audited (docs/fleet.md)


@dataclass(frozen=True)
class _ExperimentTopics:
    """The two topics one audit reads: its experiment's (infra.experiments)."""

    trajectories: str
    verdicts: str


READBACK_BATCH = 512  # referenced verdicts whose members' turns are read back together


async def _scorers_of(cfg: PipelineConfig, experiment: str) -> tuple[PRMConfig, Any]:
    """The scorer stack the workers score ``experiment`` with, and the judge hosts it may call:
    the config file's for the default experiment, the registry's declaration otherwise (under
    the same allow-lists a worker applies, docs/security.md)."""
    if experiment == DEFAULT_EXPERIMENT:
        return cfg.prm, cfg.worker.allowed_judge_hosts
    from infra.experiments import UnknownExperiment
    from infra.registry import recorded_experiment, removed_note
    from scoring_workers.judge.hosts import effective_allow_list
    from scoring_workers.prm.capabilities import record_prm

    try:
        recorded = await recorded_experiment(cfg, experiment)
    except UnknownExperiment as exc:
        raise AuditError(f"nothing to re-score with: {exc}") from None
    if recorded.removed:  # its last declaration, kept by the removal record: what its verdicts were scored with
        print(removed_note(cfg, recorded), file=sys.stderr)
    spec = recorded.spec
    if spec is None:
        raise AuditError(
            f"nothing to re-score with: experiment {experiment!r} was removed by a record that kept "
            "no declaration (a tombstone); declare it again with `prm-pipeline experiment add` to audit it"
        )
    prm = record_prm(
        spec.prm,
        cfg.worker.scorer_profiles,
        allowed_prefixes=cfg.worker.allowed_scorer_modules,
        key=f"experiment {experiment!r} prm",
    )  # what a worker builds: profiles, capabilities
    return prm, effective_allow_list(cfg.prm, cfg.worker.allowed_judge_hosts, cfg.worker.scorer_profiles)


def _start_offsets(options: AuditOptions, topics: _ExperimentTopics) -> dict[str, dict[int, int]]:
    """``--from-offsets`` as topic -> partition -> offset; naming any topic but the two audited is an error.

    A topic of another experiment (or a typo) would otherwise be ignored silently and the
    audit would read its own topics from the start (or ``--since``).
    """
    offsets = {k: dict(v) for k, v in (options.from_offsets or {}).items()}
    stray = sorted(set(offsets) - {topics.trajectories, topics.verdicts})
    if stray:
        raise AuditError(
            f"--from-offsets names {stray}; only {topics.trajectories!r} and {topics.verdicts!r} are audited"
        )
    return offsets


async def _read_verdicts(
    cfg: PipelineConfig,
    topic: str,
    auditor: Auditor,
    *,
    start: Mapping[int, int] | None,
    since_ms: int | None,
    on_total: Callable[[int], None],
    on_record: Callable[[], None],
    ends_out: dict[int, int],
) -> None:
    """Add every verdict in the verdicts topic's snapshot to ``auditor``, with its turns.

    Verdicts published with ``worker.verdict_tokens: reference`` carry references instead
    of turns; their turns are read back :data:`READBACK_BATCH` verdicts at a time, as the
    trainer does.
    """
    tokens = VerdictTokens(cfg)
    try:
        referenced: list[GroupVerdict] = []
        async for record in read_snapshot(
            cfg, topic, start=start, since_ms=since_ms, on_total=on_total, ends_out=ends_out
        ):
            on_record()
            verdict = None if record is None else auditor.decode_verdict(record.value, record.headers)
            if verdict is not None and needs_tokens(verdict):
                referenced.append(verdict)
            elif verdict is not None:
                auditor.add_verdict(verdict)
            if len(referenced) >= READBACK_BATCH:
                for v in await tokens.resolve(referenced):
                    auditor.add_verdict(v)
                referenced = []
        for v in await tokens.resolve(referenced):
            auditor.add_verdict(v)
    finally:
        await tokens.aclose()


async def audit(
    cfg: PipelineConfig,
    options: AuditOptions | None = None,
    *,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> AuditReport:
    """Run one audit: read both topics, re-score, compare, write ``--out`` and the summary.

    Returns the :class:`AuditReport`; its ``exit_code`` is 1 when anything differs.
    ``options.experiment`` picks the two topics (the experiment's own) and the records audited.
    """
    options = options or AuditOptions()
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    topics = _ExperimentTopics(
        trajectories_topic(cfg.topics.trajectories, options.experiment),
        verdicts_topic(cfg.topics.verdicts, options.experiment),
    )
    offsets = _start_offsets(options, topics)
    timeout_s = options.timeout_s if options.timeout_s is not None else cfg.worker.scorer_timeout_s
    prm, hosts = await _scorers_of(cfg, options.experiment)
    with judge_hosts_allowed(hosts):  # re-scoring calls judges too
        scope, runner, owned = await build_runners(prm, allowed_prefixes=cfg.worker.allowed_scorer_modules)
    try:
        progress = _progress(stderr, options.progress)
        with progress:
            verdict_task = progress.add_task("reading verdicts", total=0)
            rescore_task = progress.add_task("re-scoring", total=None, start=False)
            traj_task = progress.add_task("reading trajectories", total=0)
            auditor = Auditor(
                scope=scope,
                runner=runner,
                tol=options.tolerance,
                groups=options.groups,
                timeout_s=timeout_s,
                concurrency=options.concurrency,
                max_differences=options.max_differences,
                on_rescored=lambda n: progress.advance(rescore_task, n),
                keep_channels=cfg.worker.keep_scorer_channels,
                experiment=options.experiment,
            )

            def grow(task: Any) -> Callable[[int], None]:
                return lambda n: progress.update(task, total=(progress.tasks[task].total or 0) + n)

            ends: dict[str, dict[int, int]] = {topics.verdicts: {}, topics.trajectories: {}}
            await _read_verdicts(
                cfg,
                topics.verdicts,
                auditor,
                start=offsets.get(topics.verdicts),
                since_ms=options.since_ms,
                on_total=grow(verdict_task),
                on_record=lambda: progress.advance(verdict_task),
                ends_out=ends[topics.verdicts],
            )
            progress.update(rescore_task, total=auditor.sessions_to_rescore)
            progress.start_task(rescore_task)
            async for record in read_snapshot(
                cfg,
                topics.trajectories,
                start=offsets.get(topics.trajectories),
                since_ms=options.since_ms,
                on_total=grow(traj_task),
                ends_out=ends[topics.trajectories],
            ):
                progress.advance(traj_task)
                if record is not None:
                    await auditor.feed_trajectory(record.value, record.headers)
            resume = ",".join(
                f"{t}:{p}:{o}" for t in (topics.trajectories, topics.verdicts) for p, o in sorted(ends[t].items())
            )
            report = await auditor.finish(resume_offsets=resume)
            progress.update(rescore_task, total=progress.tasks[rescore_task].completed)
    finally:
        for r in owned:
            await r.aclose()
    if options.out:
        write_findings(options.out, report.findings)
    render_summary(report, stdout, show=options.show)
    return report


def run_audit(cfg: PipelineConfig, options: AuditOptions | None = None) -> int:
    """Synchronous entry point: run :func:`audit`, return the exit code (0, 1; 2 on error)."""
    try:
        report = asyncio.run(audit(cfg, options))
    except AuditError as exc:
        print(f"audit: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return report.exit_code
