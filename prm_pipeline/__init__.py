"""The application layer: the ``prm-pipeline`` CLI and the end-to-end demo.

It is the only package that wires producers, scoring workers and the shaper
together; those three depend on ``infra`` alone.
"""
