# Two entry points (see README): `make demo` and `make test` (`make test-unit` for the inner loop).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU wheel of torch 2.13.0 lies on the project's build machines; on a GPU machine
# either keep the torch already in the venv or set TORCH_SPEC (e.g. TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-unit test-ops ops-tools test-ecosystem lint bench faults soak clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)" numpy
	$(BIN)/python -m pip install -q -e ".[local,dev,demo]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/prm-pipeline --config config/demo.yaml demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

# The inner loop: pure-logic tests only, no broker or Redis (seconds).
test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q

lint: $(STAMP)
	$(BIN)/ruff check .

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
# The ecosystem suite (tests/ecosystem): the verl integration against real verl in its own
# environment, OpenRLHF's reward client from its wheel against the gateway, and the Node.js
# producer example. Needs the package registries (PyPI, npm).
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
	OPENRLHF_AGENT_PY=$(OPENRLHF_AGENT) $(ECO_BIN)/python -m pytest tests/ecosystem -W ignore::UserWarning -W ignore::DeprecationWarning
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
	rm -rf $(VENV) $(ECO_VENV) .pytest_cache .prm-local examples/node-producer/node_modules
