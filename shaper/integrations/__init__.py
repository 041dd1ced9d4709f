"""Adapters for training frameworks. Each submodule imports its framework; none is imported here,
so the frameworks stay optional dependencies (``shaper.integrations.verl`` needs ``verl``). What
they share — settings, the timeout policy, the sync bridge, the text routes — is :mod:`.core`,
which imports no framework (docs/integrations/README.md)."""
