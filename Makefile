# One entry point. `make run` = the whole DAG in local single-node mode; `make serve` = its model on a page;
# `make test` = the tests.
PYTHON ?= python3
VENV ?= .venv
# PyPI's Linux wheel of torch 2.13.0 is the CUDA build; set TORCH_SPEC (e.g. add
# --index-url https://download.pytorch.org/whl/cu128) to pick another build.
TORCH_SPEC ?= torch==2.13.0
# The offline WMT14 stand-in (tests, CI, air-gapped machines); unset = the real statmt.org URLs.
SHARED_MIRROR := $(abspath ../shared/data/statmt-mirror)
WMT14_MIRROR ?= $(if $(wildcard $(SHARED_MIRROR)),$(SHARED_MIRROR),)
export WMT14_MIRROR
# The offline Multi30k stand-in (same layout as github.com/multi30k/dataset/raw/<commit>/).
SHARED_MULTI30K := $(abspath ../shared/data/multi30k)
MULTI30K_MIRROR ?= $(if $(wildcard $(SHARED_MULTI30K)),$(SHARED_MULTI30K),)
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

.PHONY: install run multi30k serve plan test test-unit test-slow test-extended ui bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install "$(TORCH_SPEC)" uv
	@# torch with pip (it reads pip's own config, e.g. a find-links folder holding a CPU wheel); the rest
	@# with uv, which installs the ~190 packages in parallel: 18 s instead of pip's ~2.5 min (2 cores, AVX2;
	@# measured before --compile-bytecode, which adds ~24 s on 2 cores, AVX512-BF16).
	@# --compile-bytecode: uv, unlike pip, writes no .pyc files, and where PYTHONDONTWRITEBYTECODE is
	@# set nothing ever does, so every Ray worker compiled ray, ray.data, ray.train and mlflow from
	@# source at each start (ray.train: 3.9 s of CPU instead of 1.5 s on 2 cores, AVX512-BF16; docs/benchmarks.md,
	@# "Process start-up").
	$(BIN)/uv pip install --compile-bytecode --python $(BIN)/python -e '.[test]'
	touch $@

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
