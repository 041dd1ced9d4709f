"""Monitoring as code: alert rules (:mod:`.alerts`) and the Grafana dashboard
(:mod:`.dashboard`), written to ``infra/deploy/`` by ``python -m infra.monitoring``."""
