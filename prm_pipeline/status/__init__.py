"""``prm-pipeline status``: the one screen an operator runs first (docs/deploy.md, "Operating it").

:mod:`.report` holds the data and the health rules, :mod:`.collect` reads Kafka and
Redis, :mod:`.render` draws it, :mod:`.exporter` serves it to Prometheus, :mod:`.command`
is the CLI.
"""

from prm_pipeline.status.report import Problem, StatusReport, assess

__all__ = ["Problem", "StatusReport", "assess"]
