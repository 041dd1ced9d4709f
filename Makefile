# Two entry points (see README): `make demo` and `make test` (`make test-unit` for the inner loop).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU wheel of torch 2.13.0 lies on the project's build machines; on a GPU machine
# either keep the torch already in the venv or set TORCH_SPEC (e.g. TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-unit test-ops ops-tools test-ecosystem test-ecosystem-areal lint bench faults soak clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)" numpy
	$(BIN)/python -m pip install -q -e ".[local,dev,demo,bench]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/prm-pipeline --config config/demo.yaml demo

test: $(STAMP) lint
	$(BIN)/python -m pytest

# The inner loop: pure-logic tests only, no broker or Redis, none marked slow (no child Python
# processes, no kernel compiles); `make test` runs those too.
test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q -m "not slow"

# ruff (lint rules), the formatter's check and mypy (pyproject.toml [tool.mypy]): `make test` runs these first.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Operations suite (tests/ops): the alert rules through `promtool check rules` / `promtool
# test rules`, and a real Prometheus server scraping the embedded stack. Both binaries come
# from the Debian package `prometheus`, installed here when missing (apt-get; root or sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
ops-tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
	@promtool --version 2>&1 | head -1

test-ops: $(STAMP) ops-tools
	$(BIN)/python -m pytest tests/ops
# The ecosystem suite (tests/ecosystem): the verl, TRL and verifiers integrations against the real
# packages in their own environment, OpenRLHF's reward client from its wheel against the gateway,
# and the Node.js producer example. Needs the package registries (PyPI, npm). AReaL pins another
# torch, so it has an environment and a target of its own below.
ECO_VENV  := .venv-ecosystem
ECO_BIN   := $(ECO_VENV)/bin
ECO_STAMP := $(ECO_VENV)/.installed

$(ECO_STAMP): pyproject.toml Makefile
	test -x $(ECO_BIN)/python || $(PYTHON) -m venv $(ECO_VENV)
	echo "$(TORCH_SPEC)" > $(ECO_VENV)/constraints.txt  # nothing may replace our torch with another build
	$(ECO_BIN)/python -c "import torch" 2>/dev/null || $(ECO_BIN)/python -m pip install -q "$(TORCH_SPEC)" numpy
	$(ECO_BIN)/python -m pip install -q -c $(ECO_VENV)/constraints.txt -e ".[local,ecosystem]"
	touch $(ECO_STAMP)

# OpenRLHF's reward client (openrlhf/utils/agent.py) from its wheel, without its GPU dependencies.
OPENRLHF_VERSION := 0.11.2
OPENRLHF_AGENT   := $(ECO_VENV)/openrlhf-$(OPENRLHF_VERSION)/agent.py

$(OPENRLHF_AGENT): $(ECO_STAMP) tests/ecosystem/fetch_openrlhf.py
	$(ECO_BIN)/python tests/ecosystem/fetch_openrlhf.py $(OPENRLHF_VERSION) $@

test-ecosystem: $(ECO_STAMP) $(OPENRLHF_AGENT)
	cd examples/node-producer && npm ci --no-audit --no-fund
	HF_HUB_OFFLINE=1 OPENRLHF_AGENT_PY=$(OPENRLHF_AGENT) $(ECO_BIN)/python -m pytest tests/ecosystem --ignore=tests/ecosystem/areal \
		-W ignore::UserWarning -W ignore::DeprecationWarning

# AReaL 1.0.4 in .venv-areal: areal with --no-deps (its torch<2.11 pin is metadata only), then
# the `areal-runtime` extra; the constraints file keeps our torch build.
AREAL_VENV  := .venv-areal
AREAL_BIN   := $(AREAL_VENV)/bin
AREAL_STAMP := $(AREAL_VENV)/.installed

$(AREAL_STAMP): pyproject.toml Makefile
	test -x $(AREAL_BIN)/python || $(PYTHON) -m venv $(AREAL_VENV)
	echo "$(TORCH_SPEC)" > $(AREAL_VENV)/constraints.txt
	$(AREAL_BIN)/python -c "import torch" 2>/dev/null || $(AREAL_BIN)/python -m pip install -q "$(TORCH_SPEC)" numpy
	$(AREAL_BIN)/python -m pip install -q --no-deps areal==1.0.4
	$(AREAL_BIN)/python -m pip install -q -c $(AREAL_VENV)/constraints.txt -e ".[local,areal-runtime]"
	touch $(AREAL_STAMP)

test-ecosystem-areal: $(AREAL_STAMP)
	HF_HUB_OFFLINE=1 $(AREAL_BIN)/python -m pytest tests/ecosystem/areal -W ignore::UserWarning -W ignore::DeprecationWarning
# Endurance smoke for CI (about 4 minutes; docs/capacity.md): memory and Redis keys stay bounded.
soak: $(STAMP)
	$(BIN)/prm-pipeline bench soak --minutes 3

bench: $(STAMP)
	$(BIN)/prm-pipeline bench schema
	$(BIN)/prm-pipeline bench runner
	$(BIN)/prm-pipeline bench shaping

# 10,000 malformed records mixed with valid groups: every one accounted for (a few minutes)
faults: $(STAMP)
	$(BIN)/prm-pipeline bench faults

clean:
	rm -rf $(VENV) $(ECO_VENV) $(AREAL_VENV) .pytest_cache .prm-local examples/node-producer/node_modules
