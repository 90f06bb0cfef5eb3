# Two commands on a fresh machine (see README.md):
#   make demo    set up .venv (torch 2.13.0 CPU + l2l) and train a 2-worker job
#   make test    set up .venv if needed and run the test suite
PYTHON ?= python3
VENV   ?= .venv
# The torch to install first; empty keeps the torch already in the environment (GPU images).
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-slow bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(TORCH),$(BIN)/pip install -q "$(TORCH)")
	$(BIN)/pip install -q -e '.[test,hf]'
	touch $@

setup: $(STAMP)

demo: $(STAMP)
	mkdir -p runs
	$(BIN)/l2l-launch --workers 2 --model bert --layers 4 --hidden 64 --steps 60 --lr 3e-3 \
		--summary-json runs/demo.json --save runs/demo.safetensors

test: $(STAMP)
	$(BIN)/python -m pytest

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
