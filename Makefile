# NeuralDBG: `make demo` and `make test` each set up everything they need on a fresh machine
# (a virtualenv in .venv, torch from PyPI, the Rust extension built by maturin) and are fast
# when already set up.

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMPS  := .stamps
SOURCES := $(shell find crates python -type f \( -name '*.rs' -o -name '*.py' -o -name '*.pyi' -o -name 'Cargo.toml' -o -name '*.js' -o -name '*.css' -o -name '*.html' \) 2>/dev/null) Cargo.toml pyproject.toml

.PHONY: all demo demo-burn jax test test-rust test-python lint lint-rust lint-python bench bench-overhead bench-jax bench-models bench-frameworks bench-run bench-confirm bench-distributed bench-engine bench-burn bench-memory bench-diagnosis bench-corpus bench-report bench-trace gpu-check bench-kept-memory build browser terminal report-screenshot watch-screenshot clean

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

# JAX (flax, optax) and Keras 3 for tests/test_jax.py, tests/test_keras.py and bench/jax_overhead.py
# only: optional frameworks of the package, installed into .venv once (CPU wheels from PyPI).
$(STAMPS)/jax: requirements-jax.txt $(STAMPS)/deps
	$(PY) -m pip install --quiet -r requirements-jax.txt
	@mkdir -p $(STAMPS) && touch $@

jax: $(STAMPS)/jax

# Headless Chromium renders the HTML report in the tests: Debian's package, installed once (CI
# runs as root on a clean machine; elsewhere through sudo). Nothing to do when it is there.
CHROMIUM ?= /usr/bin/chromium
$(CHROMIUM):
	$(if $(filter 0,$(shell id -u)),,sudo) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(if $(filter 0,$(shell id -u)),,sudo) apt-get install -y -qq chromium >/dev/null

browser: $(CHROMIUM)

# tmux is the real terminal `neuraldbg watch` is tested in (tests/test_watch.py): Debian's
# package, installed once like Chromium.
TMUX ?= /usr/bin/tmux
$(TMUX):
	$(if $(filter 0,$(shell id -u)),,sudo) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(if $(filter 0,$(shell id -u)),,sudo) apt-get install -y -qq tmux >/dev/null

terminal: $(TMUX)

demo: build
	$(PY) examples/demo_vanishing_gradients.py

# The same demo written in burn (Rust, NdArray backend on CPU): no Python involved.
demo-burn:
	cargo run --release -q -p neuraldbg-burn --example vanishing_gradients

lint: lint-rust lint-python

lint-rust:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

# Python: ruff's formatter and linter under pyproject.toml's configuration.
lint-python: $(STAMPS)/deps
	$(VENV)/bin/ruff format --check python tests bench examples
	$(VENV)/bin/ruff check python tests bench examples

# (MAKEFLAGS emptied: under `make test`'s parallel part, rustdoc would try make's job server.)
test-rust:
	MAKEFLAGS= cargo test --workspace --quiet

# One pytest worker per CPU (at most 4: each holds torch, JAX and TensorFlow): much of the suite
# waits on subprocesses (torchrun jobs, scripts under `neuraldbg run`, a browser, a terminal).
# Tests of one file share a worker (their module fixtures run once).
test-python: build browser terminal $(STAMPS)/jax
	NEURALDBG_CHROMIUM=$(CHROMIUM) $(PY) -m pytest tests -n logical --maxprocesses 4 --dist loadfile

# The Rust checks and tests compile while pip downloads the Python dependencies (on a fresh
# machine each takes minutes; the two cargo commands take turns on cargo's lock, so pip is
# never left waiting for a slot); the rest runs in order (pip and maturin write one .venv).
test:
	$(MAKE) -j3 $(STAMPS)/deps lint-rust test-rust
	$(MAKE) lint-python test-python

# The scenario suite, then the external suite (published buggy programs, ported; a report).
bench-diagnosis: build
	$(PY) bench/scoreboard.py
	$(PY) bench/external_scoreboard.py

# The mutation corpus (bench/corpus): base programs and their mutants trained under NeuralDbg,
# the external suite's evidence, then the causes' evidence weights fitted (numpy) and reported on
# held-out base programs and the external suite. CORPUS_ARGS sizes it (e.g. --seeds 3 --pairs 400
# --jobs 4); the fitted table is written to bench/corpus/fitted_table.json.
CORPUS_ARGS ?=
bench-corpus: build
	$(PY) bench/corpus/run.py --out runs/corpus/corpus.jsonl $(CORPUS_ARGS)
	$(PY) bench/external_scoreboard.py --evidence runs/corpus/external.jsonl
	$(PY) bench/corpus/fit.py runs/corpus/corpus.jsonl --external runs/corpus/external.jsonl \
		--table bench/corpus/fitted_table.json

# Size and generation time of the report for 1,000 layers x 100,000 synthetic steps (release).
bench-report:
	cargo test --release -p neuraldbg-core --lib report::tests::scale_1000_layers_100k_steps -- --nocapture

# docs/report.png: the report of a scenario with a planted failure, as Chromium draws it.
report-screenshot: build browser
	$(PY) bench/report.py cnn_lr_schedule_explosion -o runs/report.html --png docs/report.png

# docs/watch.png: `neuraldbg watch` following a live run in tmux, as tests/test_watch.py sees it.
watch-screenshot: build browser terminal
	NEURALDBG_CHROMIUM=$(CHROMIUM) NEURALDBG_SCREENSHOTS=docs $(PY) -m pytest -q tests/test_watch.py -k survives

bench-trace: build
	$(PY) bench/trace_size.py

# NeuralDBG 1.3.2 from PyPI shares our import name `neuraldbg`: it gets its own virtualenv,
# with the same torch version as ours, and bench/overhead.py runs it in a subprocess.
BENCH_VENV ?= .bench-venv
$(STAMPS)/bench-venv: $(STAMPS)/deps
	python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install --quiet numpy "neuraldbg==1.3.2" \
		"torch==$$($(PY) -c 'import torch; print(torch.__version__.split("+")[0])')"
	@mkdir -p $(STAMPS) && touch $@

# `make bench`: the overhead table (plain vs monitored, interleaved; minutes), third-party models
# and Lightning, a 2-process DDP and FSDP2 job, the engine's ingest throughput and the burn
# adapter's overhead. `make bench-memory`: 10,000 layers x 1,000,000 steps (minutes).
bench: bench-overhead bench-models bench-frameworks bench-run bench-distributed bench-engine bench-burn bench-jax

bench-overhead: build $(STAMPS)/bench-venv
	$(PY) bench/overhead.py --legacy-python $(BENCH_VENV)/bin/python

# Watching a 2-process DDP and FSDP2 job (gloo, CPU) against the same job unwatched, and the
# collectives we add per step (counted).
bench-distributed: build
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=2 bench/distributed_overhead.py

# A jitted flax nnx MLP step and a Keras 3 fit (JAX backend), watched against unwatched.
bench-jax: build $(STAMPS)/jax
	$(PY) bench/jax_overhead.py
	$(PY) bench/jax_reading.py

# Third-party models (torchvision ResNet-18, Hugging Face GPT-2) eager and under torch.compile,
# each against the same setup unwatched.
bench-models: build
	$(PY) bench/overhead.py --models resnet18,gpt2 --arms plain,A/A,neuraldbg,compiled,compiled+neuraldbg --no-legacy

# Trainer.fit under PyTorch Lightning with and without neuraldbg.lightning.NeuralDbgCallback.
bench-frameworks: build
	$(PY) bench/frameworks.py

# `neuraldbg run train.py` against the same script with `with NeuralDbg(model)` in its loop.
bench-run: build
	$(PY) bench/run_overhead.py

# The external suite under `--confirm`: each program, buggy and fixed, through
# `neuraldbg.run(..., confirm=True)`; the remedies' verdicts against the labels (an hour or more;
# not part of `make bench`). CONFIRM_ARGS narrows it (e.g. `IPS-5 -v`).
CONFIRM_ARGS ?=
bench-confirm: build
	$(PY) bench/external_confirm.py --json runs/external-confirm.json $(CONFIRM_ARGS)

bench-engine:
	cargo bench -p neuraldbg-core --bench observe
	cargo run --release -q -p neuraldbg-core --example throughput

# A burn training step watched through neuraldbg-burn vs the same loop unwatched (release).
bench-burn:
	cargo bench -q -p neuraldbg-burn --bench step

bench-memory:
	cargo run --release -p neuraldbg-core --example memory

# On a machine with a CUDA device: watched vs unwatched step time, peak memory and synchronizing
# calls per step (ResNet-50, a GPT-2-small-sized model; eager and compiled, bf16), against the
# targets; exits non-zero past them. First, every scenario on the GPU against the same on the CPU
# (bench/gpu_scenarios.py). Elsewhere both say "no CUDA device" and exit 0.
gpu-check: build
	$(PY) bench/gpu_scenarios.py
	$(PY) bench/gpu_check.py

# Bytes the collector keeps that autograd did not save (host path and the CUDA path's stand-in).
bench-kept-memory: build
	$(PY) bench/kept_memory.py

clean:
	rm -rf $(STAMPS) target
