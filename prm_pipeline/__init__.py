"""The application layer: the ``prm-pipeline`` CLI and the end-to-end demo.

Its commands run producers, scoring workers and the shaper together (the verl
integration and the demo's tiny model also join two of them). It re-exports the root
of every exception the packages raise on purpose and its typed subtrees
(:mod:`infra.errors`), so a library user has one thing to catch::

    from prm_pipeline import PRMPipelineError
"""

from infra.errors import (
    ConfigurationError,
    PRMPipelineError,
    ScoringError,
    ServiceError,
    TrainingError,
    WireError,
)

__all__ = ["ConfigurationError", "PRMPipelineError", "ScoringError", "ServiceError", "TrainingError", "WireError"]
