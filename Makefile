# Two entry points (see README): `make demo` and `make test`. Everything else is set-up.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU wheel of torch 2.13.0 lies on the project's build machines; on a GPU machine
# either keep the torch already in the venv or set TORCH_SPEC (e.g. TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench soak clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)" numpy
	$(BIN)/python -m pip install -q -e ".[local,dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/prm-pipeline --config config/demo.yaml demo

test: $(STAMP)
	$(BIN)/python -m pytest

# Endurance smoke for CI (about 4 minutes; docs/capacity.md): memory and Redis keys stay bounded.
soak: $(STAMP)
	$(BIN)/prm-pipeline bench soak --minutes 3

bench: $(STAMP)
	$(BIN)/prm-pipeline bench schema
	$(BIN)/prm-pipeline bench runner
	$(BIN)/prm-pipeline bench shaping

clean:
	rm -rf $(VENV) .pytest_cache .prm-local
