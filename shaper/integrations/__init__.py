"""Adapters for training frameworks. Each submodule imports its framework; none is imported here,
so the frameworks stay optional dependencies (``shaper.integrations.verl`` needs ``verl``)."""
