"""One experiment's share of the scoring fleet, read from the workers' ``/metrics``.

``prm-pipeline status --experiment ID --worker-metrics URL ...`` scrapes each worker's
Prometheus endpoint and sums the per-experiment series the workers export
(docs/fleet.md):

* ``prm_worker_experiment_records_total{experiment,kind}`` -- records consumed, by kind;
* ``prm_worker_experiment_verdicts_total{experiment,status}`` -- verdicts published, by status;
* ``prm_worker_experiment_in_flight{experiment}`` -- records being scored now;
* ``prm_worker_experiment_slots{experiment}`` -- the in-flight slots the fair scheduler gives it.

:func:`experiment_metrics` is pure (text in, summary out) so it is tested on a sample;
:func:`scrape` does the HTTP. Kafka and Redis tell the rest of the experiment's story
(lag on its topics, its open groups); see :mod:`prm_pipeline.status.collect`.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

from infra.config import ConfigError
from prm_pipeline.status.report import ExperimentSummary

RECORDS = "prm_worker_experiment_records_total"
VERDICTS = "prm_worker_experiment_verdicts_total"
IN_FLIGHT = "prm_worker_experiment_in_flight"
SLOTS = "prm_worker_experiment_slots"

MAX_BODY_BYTES = 32 * 1_048_576  # a worker's /metrics is a few hundred KiB; refuse anything absurd


def experiment_metrics(texts: Iterable[str], experiment: str) -> ExperimentSummary:
    """The ``experiment``'s series summed over the workers' metrics ``texts`` (Prometheus text format).

    Counters and gauges add up across workers (each worker counts its own records and
    holds its own slots). ``present`` is False when no text carries a series of the experiment.
    """
    summary = ExperimentSummary(experiment=experiment)
    for text in texts:
        summary.sources += 1
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("experiment") != experiment:
                    continue
                if sample.name == RECORDS:
                    kind = sample.labels.get("kind", "")
                    summary.records[kind] = summary.records.get(kind, 0.0) + sample.value
                elif sample.name == VERDICTS:
                    status = sample.labels.get("status", "")
                    summary.verdicts[status] = summary.verdicts.get(status, 0.0) + sample.value
                elif sample.name == IN_FLIGHT:
                    summary.in_flight = (summary.in_flight or 0.0) + sample.value
                elif sample.name == SLOTS:
                    summary.slots = (summary.slots or 0.0) + sample.value
                else:
                    continue
                summary.present = True
    return summary


def _get(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # an http(s) URL the operator gave
        body = response.read(MAX_BODY_BYTES + 1)
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"answer larger than {MAX_BODY_BYTES} bytes")
    return body.decode("utf-8", errors="replace")


async def scrape(urls: Iterable[str], experiment: str, *, timeout_s: float = 5.0) -> ExperimentSummary:
    """Read every URL (concurrently, each bounded by ``timeout_s``) and sum ``experiment``'s series.

    An endpoint that does not answer is listed in ``unreachable`` (``url: why``); the
    others still count."""
    urls = list(urls)
    if any(not u.startswith(("http://", "https://")) for u in urls):
        bad = next(u for u in urls if not u.startswith(("http://", "https://")))
        raise ConfigError(f"--worker-metrics {bad!r}: expected an http:// or https:// URL of a worker's /metrics")
    results = await asyncio.gather(*(asyncio.to_thread(_get, u, timeout_s) for u in urls), return_exceptions=True)
    texts, unreachable = [], []
    for url, result in zip(urls, results):
        if isinstance(result, BaseException):
            unreachable.append(f"{url}: {type(result).__name__}: {result}"[:300])
        else:
            texts.append(result)
    summary = experiment_metrics(texts, experiment)
    summary.unreachable = unreachable
    return summary
