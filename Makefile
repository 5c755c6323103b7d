# NeuralDBG: `make demo` and `make test` each set up everything they need on a fresh machine
# (a virtualenv in .venv, torch from PyPI, the Rust extension built by maturin) and are fast
# when already set up.

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMPS  := .stamps
SOURCES := $(shell find crates python -type f \( -name '*.rs' -o -name '*.py' -o -name '*.pyi' -o -name 'Cargo.toml' \) 2>/dev/null) Cargo.toml pyproject.toml

.PHONY: all demo test test-rust test-python lint bench bench-overhead bench-engine bench-memory bench-diagnosis build clean

all: test

$(PY):
	python3 -m venv $(VENV)

$(STAMPS)/deps: requirements-dev.txt | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	@mkdir -p $(STAMPS) && touch $@

$(STAMPS)/build: $(STAMPS)/deps $(SOURCES)
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release --quiet
	@mkdir -p $(STAMPS) && touch $@

build: $(STAMPS)/build

demo: build
	$(PY) examples/demo_vanishing_gradients.py

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

test-rust:
	cargo test --workspace --quiet

test-python: build
	$(PY) -m pytest tests

test: lint test-rust test-python

bench-diagnosis: build
	$(PY) bench/scoreboard.py

# NeuralDBG 1.3.2 from PyPI shares our import name `neuraldbg`: it gets its own virtualenv,
# with the same torch version as ours, and bench/overhead.py runs it in a subprocess.
BENCH_VENV ?= .bench-venv
$(STAMPS)/bench-venv: $(STAMPS)/deps
	python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install --quiet numpy "neuraldbg==1.3.2" \
		"torch==$$($(PY) -c 'import torch; print(torch.__version__.split("+")[0])')"
	@mkdir -p $(STAMPS) && touch $@

# `make bench`: the overhead table (plain vs monitored, interleaved; minutes) and the engine's
# ingest throughput. `make bench-memory`: 10,000 layers x 1,000,000 steps (minutes).
bench: bench-overhead bench-engine

bench-overhead: build $(STAMPS)/bench-venv
	$(PY) bench/overhead.py --legacy-python $(BENCH_VENV)/bin/python

bench-engine:
	cargo bench -p neuraldbg-core --bench observe

bench-memory:
	cargo run --release -p neuraldbg-core --example memory

clean:
	rm -rf $(STAMPS) target
