# Every target creates or reuses the pinned venv first (scripts/env.sh: seconds when nothing changed).
POLICY ?= lagkv
BUDGET ?= 0.5
PORT ?= 30000
ARGS ?=
WORKERS ?= 2
ENV := bash scripts/env.sh

.PHONY: help env wheel gpu-bundle serve serve-cluster test test-long test-fast faults lint model-path bench-kvpress docs docs-serve

## List every target with its description.
help:
	@awk '/^## /{d = d (d ? " " : "") substr($$0, 4); next} /^[A-Za-z0-9_-]+:/{split($$0, t, ":"); printf "  %-14s %s\n", t[1], d; d = ""; next} {d = ""}' $(MAKEFILE_LIST)

## Create or reuse the pinned venv (scripts/env.sh) and print nothing.
env:
	@$(ENV) >/dev/null

## Build the wheel a GPU user installs: dist/sgl_kvevict-<version>-py3-none-any.whl (scripts/wheel.sh).
wheel:
	@PY=$$($(ENV)) && PYTHON=$$PY bash scripts/wheel.sh

## Python 3.12 wheels, this wheel and an 8B-shaped dummy model for scripts/gpu_session.sh: gpu-bundle/ (at most 64 MiB).
gpu-bundle:
	@PY=$$($(ENV)) && PYTHON=$$PY bash scripts/gpu_bundle.sh

## Start the real SGLang server on the embedded SmolLM2 with a KV policy (CPU flags added when there is no GPU).
serve:
	@PY=$$($(ENV)) && $$PY -m sgl_kvevict.launch --kv-policy $(POLICY) --kv-budget $(BUDGET) --port $(PORT) $(ARGS)

## N workers (each with the plugin) behind sglang-router's cache-aware policy; the router listens on PORT.
serve-cluster:
	@PY=$$($(ENV)) && $$PY -m sgl_kvevict.cluster --workers $(WORKERS) --port $(PORT) -- --kv-policy $(POLICY) --kv-budget $(BUDGET) $(ARGS)

## The test suite CI runs: ruff, unit, integration on SGLang's real pools, end-to-end on the real server; not the `long` tests.
## OpenMP threads wait passively (as the CPU servers do, sgl_kvevict/launch.py): the suite shares 2 cores with its servers.
test:
	@PY=$$($(ENV)) && echo "[test] ruff" && $$PY -m ruff check . && $$PY -m ruff format --check . && \
	  echo "[test] pytest" && $$PY -m sgl_kvevict.model >/dev/null && \
	  OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $$PY -m pytest -v -rs --durations=25 -m "not long" tests

## The long end-to-end tests (marker `long`: memory pressure, soak, sweeps, the cluster); not in CI. Run before a release.
test-long:
	@PY=$$($(ENV)) && $$PY -m sgl_kvevict.model >/dev/null && \
	  OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $$PY -m pytest -v -rs --durations=25 -m long tests

## Only the tests that need no server.
test-fast:
	@PY=$$($(ENV)) && $$PY -m pytest -v -m "not server" tests

## Planted faults (tests/faults/*.patch): apply each to this checkout, run the tests that must catch it, revert; a table of fault, catching test, seconds. Needs a clean tree.
faults:
	@bash scripts/planted_faults.sh

## ruff check and ruff format --check.
lint:
	@PY=$$($(ENV)) && $$PY -m ruff check . && $$PY -m ruff format --check .

## Print the embedded SmolLM2's path (converting it once).
model-path:
	@PY=$$($(ENV)) && $$PY -m sgl_kvevict.model

## Peer cross-check against kvpress (its own venv, scripts/kvpress_env.sh); writes results/kvpress-crosscheck/. Slow: not in `make test`.
bench-kvpress:
	@PY=$$($(ENV)) && bash scripts/kvpress_env.sh >/dev/null && \
	  HF_HUB_OFFLINE=1 TQDM_DISABLE=1 nice -n 10 $$PY benchmarks/kvpress_check.py $(ARGS)

## Build docs/ into a site (site/) with mkdocs + material, in a venv of their own (scripts/docs_env.sh). Not part of `make test`.
docs:
	@DPY=$$(bash scripts/docs_env.sh) && $$DPY -m mkdocs build -q

## Serve the docs site at http://127.0.0.1:8000 (reloads on edits).
docs-serve:
	@DPY=$$(bash scripts/docs_env.sh) && $$DPY -m mkdocs serve
