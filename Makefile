# The README's two commands: `make demo` and `make test`. Everything else is for developers.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PIP_CACHE_DIR ?= $(HOME)/.cache/pip
export UV_CACHE_DIR ?= $(HOME)/.cache/uv
# The release: one version (pyproject.toml's) for the package, the images and the chart; the
# registry a release publishes to (.github/workflows/release.yaml, docs/release.md).
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
REGISTRY ?= ghcr.io/elastic-diloco
# JAX on CPU: keep XLA from grabbing every core for its thread pool in tests.
export JAX_PLATFORMS ?= cpu

.PHONY: venv demo test lint typecheck unit unit-deps validators crds bench bench-quick e2e e2e-two-clusters e2e-kind e2e-kind-two-clusters cluster-up cluster-down e2e-deps images clean print-version release-chart release-images release-push locks

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -x $(BIN)/uv || $(BIN)/python -m pip install -q uv
	$(BIN)/uv pip install -q --python $(BIN)/python -e '.[trainer,operator,dev,text,flax,orbax,gcs]'
	touch $(STAMP)

demo: venv
	$(BIN)/diloco local run examples/local.yaml --chaos

lint: venv
	$(BIN)/ruff check operator trainer tests bench e2e
	$(BIN)/ruff format --check operator trainer tests bench e2e

typecheck: venv
	$(BIN)/mypy
	# The e2e cluster harness: its modules import each other as top-level modules.
	MYPYPATH=e2e/cluster $(BIN)/mypy --explicit-package-bases e2e/cluster/*.py
	# The e2e suite: pytest puts e2e/ and e2e/tests/ on the path (conftest, runs).
	MYPYPATH=e2e:e2e/tests $(BIN)/mypy --explicit-package-bases e2e/conftest.py e2e/real_pods.py e2e/two_clusters.py e2e/tests/*.py

unit: venv validators
	$(BIN)/python -m pytest -q tests

# The Go checkers two unit tests run (crds/validate: the API server's own CRD, CEL and object
# validation code), cached like the e2e binaries; rebuilt only when their sources change.
VALIDATE_BIN := $(or $(DILOCO_E2E_CACHE),$(HOME)/.cache/diloco-e2e)/bin
VALIDATE_SRC := crds/validate/build.sh $(wildcard crds/validate/*.go crds/validate/go.* \
	crds/validate/objcheck/*.go crds/validate/objcheck/go.* crds/validate/vapcheck/*.go)
validators: $(VALIDATE_BIN)/crdcheck $(VALIDATE_BIN)/objcheck $(VALIDATE_BIN)/vapcheck

$(VALIDATE_BIN)/crdcheck $(VALIDATE_BIN)/objcheck $(VALIDATE_BIN)/vapcheck &: $(VALIDATE_SRC)
	bash crds/validate/build.sh

crds: venv
	$(BIN)/python -m diloco_operator.api.crdgen --out crds/

# Serial on purpose: the e2e set-up's builds (tens of minutes cold) beside the unit tests made a
# timing-sensitive unit test fail on a cold machine (docs/experiments/2026-12-05-make-test-time.md).
test: lint typecheck e2e-deps unit e2e

# What the unit tests run besides the validators: helm (chart tests), fake-gcs-server (gs://).
unit-deps:
	bash e2e/cluster/build.sh helm fakegcs

# The real control plane (etcd, kube-apiserver, -controller-manager, -scheduler, kwok, kubectl,
# helm) and the real node (kubelet, kube-proxy, CoreDNS, pause) built from the Go module proxy into
# ~/.cache/diloco-e2e: tens of minutes cold, seconds warm. Then the images (below).
e2e-deps: venv
	bash e2e/cluster/build.sh
	@if [ "$$(id -u)" = 0 ]; then $(MAKE) --no-print-directory images; fi

# The trainer (CPU JAX) and operator images from docker/, on a base made with debootstrap (needs
# root: installs docker.io and debootstrap when missing). Content-hashed: a warm call builds nothing.
# Also tagged $(REGISTRY)/<image>:$(VERSION), the names the chart and examples use.
images: venv
	RELEASE_TAG_PREFIX=$(REGISTRY) RELEASE_VERSION=$(VERSION) PYTHON=$(BIN)/python bash e2e/node/images.sh --save $${DILOCO_E2E_CACHE:-$$HOME/.cache/diloco-e2e}/images

# End-to-end suite (docs/e2e.md): a local control plane started and stopped by the fixture, or
# DILOCO_E2E_KUBECONFIG=... for an existing cluster.
e2e: venv e2e-deps
	$(BIN)/python -m pytest -q e2e -m "not two_clusters and not bench"

# One run across two clusters (docs/e2e.md, "Two clusters"): a second control plane and real node
# started beside the first, the home syncer reached through a proxy the tests cut. Needs root.
e2e-two-clusters: venv e2e-deps
	$(BIN)/python -m pytest -q e2e -m two_clusters

# The same two on kind (docs/e2e.md, "kind"): kind and its node image built here, offline; a
# cluster "diloco-e2e" (and "diloco-e2e-away") made, used and deleted. Needs root.
e2e-kind: venv e2e-deps
	PYTHON=$(BIN)/python bash e2e/kind/run.sh

e2e-kind-two-clusters: venv e2e-deps
	PYTHON=$(BIN)/python bash e2e/kind/run.sh -q e2e -m two_clusters

# A control plane for people (builds first if needed): eval "$$(make -s cluster-up)"
cluster-up:
	@bash e2e/cluster/up.sh

cluster-down:
	bash e2e/cluster/down.sh

bench: venv
	$(BIN)/python -m bench.run

bench-quick: venv
	$(BIN)/python -m bench.run --quick

# Release artefacts (docs/release.md): the chart packaged into dist/ and the four images tagged
# $(REGISTRY)/<image>:$(VERSION), each installing the pinned packages of docker/locks/.
HELM ?= helm
RELEASE_IMAGES := diloco-trainer=docker/trainer.Dockerfile \
	diloco-trainer-gpu=docker/trainer-gpu.Dockerfile \
	diloco-trainer-cpu=docker/trainer-cpu.Dockerfile \
	diloco-operator=docker/operator.Dockerfile

print-version:
	@echo $(VERSION)

release-chart:
	$(HELM) package charts/diloco-operator --version $(VERSION) --app-version $(VERSION) -d dist

release-images:
	set -e; for pair in $(RELEASE_IMAGES); do \
	  docker build -f $${pair#*=} -t $(REGISTRY)/$${pair%%=*}:$(VERSION) . ; done

release-push: release-images release-chart
	set -e; for pair in $(RELEASE_IMAGES); do docker push $(REGISTRY)/$${pair%%=*}:$(VERSION); done
	$(HELM) push dist/diloco-operator-$(VERSION).tgz oci://$(REGISTRY)/charts

# The pinned packages of the images (docker/locks/*.txt), resolved again: after a dependency or
# JAX change, and before a release.
locks: venv
	$(BIN)/python docker/lock.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
