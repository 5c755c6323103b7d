# NeuralDBG: `make demo` and `make test` each set up everything they need on a fresh machine
# (a virtualenv in .venv, torch from PyPI, the Rust extension built by maturin) and are fast
# when already set up.

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMPS  := .stamps
SOURCES := $(shell find crates python -type f \( -name '*.rs' -o -name '*.py' -o -name '*.pyi' -o -name 'Cargo.toml' \) 2>/dev/null) Cargo.toml pyproject.toml

.PHONY: all demo test test-rust test-python lint bench bench-diagnosis bench-trace build clean

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

bench-trace: build
	$(PY) bench/trace_size.py

clean:
	rm -rf $(STAMPS) target
