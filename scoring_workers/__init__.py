"""Scoring workers: the PRM scorer contract (:mod:`scoring_workers.prm`), built-in
scorers (:mod:`scoring_workers.scorers`) and the worker loop.

Deliberately empty: worker pods import subpackages directly, and importing this
package must not pull in Kafka, Redis or HTTP clients.
"""
