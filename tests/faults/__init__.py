"""Fault-injection tests: crashes, restarts, hangs and malformed input under load (docs/faults.md)."""
