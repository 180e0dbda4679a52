# One entry point. `make run` = the whole DAG in local single-node mode; `make serve` = its model on a page;
# `make test` = the tests.
PYTHON ?= python3
VENV ?= .venv
# torch's version (pyproject.toml pins the same); its build (CPU, CUDA 12.8, ...) comes from TORCH_INDEX.
TORCH_SPEC ?= torch==2.13.0
# The index torch's build comes from, handed to pip as an extra index beside PyPI and pip's own config (e.g. a
# find-links folder holding a CPU wheel): pip takes the highest version, and a build's local label
# (2.13.0+cpu, 2.13.0+cu128) ranks above PyPI's plain 2.13.0, whose Linux wheel is the CUDA 13 build.
# Default: the CPU index where no NVIDIA GPU answers `nvidia-smi -L` (no driver, no GPU, not Linux), else
# PyPI's build. `make install TORCH_INDEX=https://download.pytorch.org/whl/cu128` takes that index;
# `TORCH_INDEX=` PyPI's build only.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
NVIDIA_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_INDEX ?= $(if $(NVIDIA_GPU),,$(TORCH_CPU_INDEX))
TORCH_ARGS := $(TORCH_SPEC)$(if $(TORCH_INDEX), --extra-index-url $(TORCH_INDEX))
TORCH_WHY := $(if $(filter file,$(origin TORCH_INDEX)),$(if $(NVIDIA_GPU),nvidia-smi -L lists an NVIDIA GPU,no NVIDIA GPU: \
	nvidia-smi -L fails); TORCH_INDEX=URL picks another,TORCH_INDEX given)
# The torch build the venv holds: a stamp named by a checksum of TORCH_ARGS (and holding them), so another
# TORCH_SPEC or TORCH_INDEX names another stamp and reinstalls torch even where .installed exists.
TORCH_STAMP := $(VENV)/.torch-$(shell printf '%s' '$(TORCH_ARGS)' | cksum | cut -d ' ' -f 1)
# Every package but torch, pinned (make lock writes it).
LOCK := requirements.lock
# The data the tests read: ../shared/data where the checkout has it, else TEST_DATA, which `make test-data` fills
# from the files' public sources (TEST_DATA_BASE_URL: raw.githubusercontent.com or a mirror of its layout).
TEST_DATA ?= .test-data
TEST_DATA_BASE_URL ?= https://raw.githubusercontent.com
# The offline WMT14 stand-in (tests, CI, air-gapped machines), also for `make run` and `make plan` where
# present; WMT14_MIRROR= (empty) = the real statmt.org URLs.
SHARED_MIRROR := $(abspath ../shared/data/statmt-mirror)
WMT14_MIRROR ?= $(firstword $(wildcard $(SHARED_MIRROR) $(abspath $(TEST_DATA)/statmt-mirror)))
export WMT14_MIRROR
# The WMT14 test files as plain text (newstest2013/2014, training samples), for the tests.
WMT14_DATA ?= $(firstword $(wildcard $(abspath ../shared/data/wmt14 $(TEST_DATA)/wmt14)))
export WMT14_DATA
# The offline Multi30k stand-in (same layout as github.com/multi30k/dataset/raw/<commit>/).
SHARED_MULTI30K := $(abspath ../shared/data/multi30k)
MULTI30K_MIRROR ?= $(firstword $(wildcard $(SHARED_MULTI30K) $(abspath $(TEST_DATA)/multi30k)))
export MULTI30K_MIRROR
MULTI30K_CONFIG ?= configs/multi30k-tiny.toml
CONFIG ?= configs/local.toml
ARGS ?=
# Where `make run` and `make multi30k` record the config of a run that ends with a model
# (pipeline/run_record.py); `make serve` serves that model, so no override is repeated.
RUN_RECORD ?= work/last-run.json
# More `serve run` arguments for `make serve`: backend=ctranslate2, beam_size=5, num_replicas=2, ...
SERVE_ARGS ?=
BIN := $(VENV)/bin

.PHONY: install lock run multi30k serve plan test test-unit test-slow test-extended test-data ui bench clean

install: $(VENV)/.installed

# pip installs uv and torch (it reads pip's own config, e.g. a find-links folder holding a CPU wheel); uv
# installs the lock's ~185 packages in parallel: 18 s instead of pip's ~2.5 min (2 cores, AVX2;
# measured before --compile-bytecode, which adds ~24 s on 2 cores, AVX512-BF16).
# --compile-bytecode: uv, unlike pip, writes no .pyc files, and where PYTHONDONTWRITEBYTECODE is
# set nothing ever does, so every Ray worker compiled ray, ray.data, ray.train and mlflow from
# source at each start (ray.train: 3.9 s of CPU instead of 1.5 s on 2 cores, AVX512-BF16; docs/benchmarks.md,
# "Process start-up").
# Exactly the lock (--no-deps); then pip adds what the torch build itself needs beyond it (a CUDA build's
# runtime wheels, at the versions its metadata pins; nothing for the CPU build), held to the lock's pins
# (-c); then the project, editable; `uv pip check` fails on any requirement left unmet (a stale lock).
$(VENV)/.installed: pyproject.toml $(LOCK) $(TORCH_STAMP)
	$(BIN)/uv pip install --compile-bytecode --python $(BIN)/python --no-deps -r $(LOCK)
	$(BIN)/pip install -c $(LOCK) $(TORCH_ARGS)
	$(BIN)/uv pip install --compile-bytecode --python $(BIN)/python --no-deps -e .
	$(BIN)/uv pip check --python $(BIN)/python
	touch $@

# torch alone (--no-deps: its dependencies come from the lock), replacing whatever build was there
# (--force-reinstall: an installed 2.13.0+cu128 satisfies torch==2.13.0 too). Where TORCH_INDEX cannot
# be reached, pip warns and retries it (about 10 s), then takes the best build PyPI and its config offer
# (a CPU wheel in a find-links folder pip's config names; else PyPI's CUDA build): its last line names the build.
# A CUDA build's runtime wheels stay when a CPU build replaces it: `rm -rf .venv` for a clean venv.
$(TORCH_STAMP): | $(BIN)/uv
	@echo "make install: $(TORCH_SPEC), its build from $(or $(TORCH_INDEX),PyPI) ($(TORCH_WHY))"
	$(BIN)/pip install --no-deps --force-reinstall $(TORCH_ARGS)
	rm -f $(VENV)/.torch-*
	printf '%s\n' '$(TORCH_ARGS)' > $@

$(BIN)/uv:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install uv

# The lock: every package `make install` installs but torch, for Linux x86_64 and Python 3.11 (pyproject.toml's
# pins and its test extra). It is resolved with torch's CPU build, whose dependencies hold no CUDA runtime, so a
# CPU install never fetches one; pip downloads that wheel as `make install` would find it. Run after editing
# pyproject.toml's dependencies (tests/unit/core/test_install.py fails on a lock that misses a pin); uv keeps
# the lock's other versions where it can (`rm requirements.lock; make lock` takes the newest of everything).
lock: $(BIN)/uv
	rm -rf $(VENV)/lock-torch
	$(BIN)/pip download --no-deps --only-binary :all: --platform manylinux_2_28_x86_64 --python-version 3.11 \
		-d $(VENV)/lock-torch $(TORCH_SPEC) --extra-index-url $(TORCH_CPU_INDEX)
	$(BIN)/uv pip compile pyproject.toml --extra test --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
		--find-links $(VENV)/lock-torch --no-emit-package torch --custom-compile-command 'make lock' -o $(LOCK)
	rm -rf $(VENV)/lock-torch

run: install
	$(BIN)/python workflows/reproduce_base.py --config $(CONFIG) --record $(RUN_RECORD) $(if $(WMT14_MIRROR),--data.mirror=$(WMT14_MIRROR),) $(ARGS)

# The published Multi30k number on a CPU (README, "Reproduced here"): configs/multi30k-tiny.toml, the published
# recipe, BLEU4 41.27 in 2.9 h (2 cores, AVX512-BF16, bf16); ~3.1 h estimated (2 cores, AVX2, fp32).
# MULTI30K_CONFIG=configs/multi30k-fast.toml: 37.7 in 48 min (2 cores, AVX512-BF16, bf16).
# ARGS=--train.max_steps=2400: the recipe stopped at its step 2,400, a first model in under an hour
# (BLEU4 37.23 in 57 min; 2 cores, AVX2, fp32; docs/benchmarks.md, "A first model in an hour").
multi30k: install
	$(BIN)/python workflows/reproduce_base.py --config $(MULTI30K_CONFIG) --record $(RUN_RECORD) $(if $(MULTI30K_MIRROR),--data.mirror=$(MULTI30K_MIRROR),) $(ARGS)

# The model of the last `make run` / `make multi30k`, on Ray Serve until Ctrl-C: the page at
# http://127.0.0.1:8000/ (Ray Serve prints "Application 'default' is ready at ..." when it answers).
serve: install
	@test -f $(RUN_RECORD) || { echo "make serve: no trained model yet ($(RUN_RECORD) is written when make run or make multi30k ends with one): run make run (minutes) or make multi30k first" >&2; exit 2; }
	$(BIN)/serve run pipeline.serve.app:build_app run_record=$(RUN_RECORD) $(SERVE_ARGS)

plan: install
	$(BIN)/python workflows/reproduce_base.py --config $(CONFIG) $(if $(WMT14_MIRROR),--data.mirror=$(WMT14_MIRROR),) --plan $(ARGS)

# The import contracts first (lint-imports: a broken one stops here), then two tiers: the fast one
# first (a failure stops here, in seconds), then the rest; each prints its 25 slowest tests, and
# the total wall time comes last. Every test has a bound (pytest-timeout, pyproject.toml).
# The fast tier holds the code size limits too (tests/unit/core/test_code_size.py: functions,
# classes and modules of model/, pipeline/, workflows/ and benchmarks/).
PYTEST_TIERS := --durations=25

test: install
	@t0=$$(date +%s); \
	echo "== import contracts (lint-imports, pyproject.toml [tool.importlinter]) =="; \
	$(BIN)/lint-imports || { echo "== an import contract is broken: tests not run =="; exit 1; }; \
	echo "== fast tier (make test-unit): tests/unit, not slow =="; \
	$(BIN)/python -m pytest tests/unit -m "not slow" $(PYTEST_TIERS) || { echo "== fast tier failed: slow tier not run =="; exit 1; }; \
	t1=$$(date +%s); \
	echo "== slow tier (make test-slow): the rest =="; \
	$(BIN)/python -m pytest tests -m "not fast and not extended" $(PYTEST_TIERS); rc=$$?; \
	t2=$$(date +%s); \
	echo "== make test: fast tier $$((t1 - t0)) s, slow tier $$((t2 - t1)) s, total $$((t2 - t0)) s (exit $$rc) =="; \
	exit $$rc

test-unit: install
	$(BIN)/lint-imports
	$(BIN)/python -m pytest tests/unit -m "not slow" $(PYTEST_TIERS)

# Everything `test-unit` does not run: tests/integration and the unit tests marked slow.
test-slow: install
	$(BIN)/python -m pytest tests -m "not fast and not extended" $(PYTEST_TIERS)

# Tests that re-prove, in another setting, a path a CI test already guards (each names that test);
# not in `make test` (CI), run them before a release or when touching their path.
test-extended: install
	$(BIN)/python -m pytest tests -m extended $(PYTEST_TIERS)

# The data the tests read, into TEST_DATA (git-ignored), for a checkout without ../shared/data: every file from its
# public GitHub source at a pinned commit, checked against its sha256 (tests/support/test_data.json; ~26 MB from
# 52 files on a first run), in ../shared/data's layout; a file already there is not fetched again. Without it
# the data tests skip, naming this command. The standard library only: no venv needed.
test-data:
	$(PYTHON) -m tests.support.test_data --dest $(TEST_DATA) --base-url $(TEST_DATA_BASE_URL)

# The MLflow store of the last `make run` / `make multi30k` (its run record names it); a tracking server's
# URI is printed to open instead. Another store: make ui UI_STORE=sqlite:////path/to/mlflow.db
UI_STORE ?=
ui: install
	@uri="$(UI_STORE)"; [ -n "$$uri" ] || uri=$$($(BIN)/python -m pipeline.run_record $(RUN_RECORD) --tracking-uri) || exit 2; \
	case "$$uri" in http*) echo "the run tracked to the server $$uri: open it there"; exit 0;; esac; \
	echo "$$uri"; \
	echo "MLflow 3.17 opens on its GenAI view: pick 'Model training' (top left; remembered by the browser) or open"; \
	echo "  http://127.0.0.1:5000/#/experiments/1?workflowType=machine_learning"; \
	$(BIN)/mlflow ui --backend-store-uri "$$uri" --host 127.0.0.1 --port 5000

bench: install
	$(BIN)/uv pip install --python $(BIN)/python -e '.[test,bench]'
	$(BIN)/python benchmarks/model_bench.py
	$(BIN)/python benchmarks/data_bench.py
	$(BIN)/python benchmarks/train_bench.py
	$(BIN)/python benchmarks/decode_bench.py

clean:
	rm -rf work
