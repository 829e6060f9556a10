# The project's vocabulary. `make demo` runs the product, `make test` runs the tests;
# both do all set-up on a fresh machine first.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export VGPU_BIN_DIR ?= $(CURDIR)/.cache/bin
PYTEST_ARGS ?=
# pytest-xdist workers for test and e2e: tests that share a host path, the real node or the
# session's sandbox are in one xdist_group and never run at once (tests/README.md). 0: no workers.
# Three on a 2-core machine: the whole suite took 329 s with three, 479 s with two (tests/README.md).
PYTEST_WORKERS ?= 3
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

.PHONY: setup venv lock tools native fuzz-tools node-tools images-docker test unit e2e gpu-test lint proto demo bench images fuzz fresh-check clean

# The real node's images need root (debootstrap, chroot); elsewhere setup leaves them out and the
# real-node tests skip, naming why.
SETUP_IMAGES := $(if $(filter 0,$(shell id -u)),images,)

setup: venv tools native fuzz-tools node-tools $(SETUP_IMAGES) ## everything the tests, fuzzing and the demo need; rebuilds only what is missing

$(BIN)/.installed: pyproject.toml sandbox/pyproject.toml requirements.lock requirements-dev.lock
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c requirements-dev.lock -e '.[dev]' -e ./sandbox
	touch $@

venv: $(BIN)/.installed

# The pins: requirements.lock (the product's dependencies: the images) and requirements-dev.lock
# (with the dev extra: make venv). Regenerate after changing pyproject.toml's dependencies; the
# pins already there are kept unless the change needs others (PIP_TOOLS_ARGS=--upgrade: newest).
lock: ## requirements.lock and requirements-dev.lock from pyproject.toml (pip-tools, from PyPI)
	$(PY) -m venv $(VENV)-lock
	$(VENV)-lock/bin/pip install -q 'pip-tools==7.5.3'
	CUSTOM_COMPILE_COMMAND="make lock" $(VENV)-lock/bin/pip-compile -q --strip-extras --allow-unsafe \
	  --no-emit-index-url --no-emit-find-links $(PIP_TOOLS_ARGS) -o requirements.lock pyproject.toml
	CUSTOM_COMPILE_COMMAND="make lock" $(VENV)-lock/bin/pip-compile -q --strip-extras --allow-unsafe \
	  --no-emit-index-url --no-emit-find-links $(PIP_TOOLS_ARGS) --extra dev -o requirements-dev.lock pyproject.toml

tools: ## kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, KWOK, helm, etcd
	bash tools/build.sh

native: ## libvgpu.so and the stub driver libraries
	@if [ -f native/hook/Makefile ]; then $(MAKE) -C native/hook; fi

node-tools: ## the real node's containerd, runc, CNI plugins (Debian), kubelet, crictl, nvidia-ctk (as root)
	@bash tools/node-setup.sh

fuzz-tools: ## clang with libFuzzer for the native harnesses (apt-get, as root, where missing)
	@bash fuzz/install-tools.sh

test: setup ## unit, integration and e2e tests (no GPU)
	$(BIN)/pytest -m 'not gpu' $(XDIST) $(PYTEST_ARGS)

unit: venv
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

e2e: setup
	$(BIN)/pytest -m e2e $(XDIST) $(PYTEST_ARGS)

FUZZ_SECONDS ?= 20
fuzz: venv ## every fuzz harness for FUZZ_SECONDS each (docs/fuzzing.md); fails on any crash
	FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_PYTHON=$(BIN)/python bash fuzz/run.sh

# A GPU test that cannot run (no GPU, PyTorch, pynvml or real node) fails, naming the missing part;
# VGPU_GPU_REQUIRED=0 lets it skip instead (tests/support/skips.py).
gpu-test: venv native ## on a machine with an NVIDIA GPU
	$(BIN)/pytest -m gpu $(PYTEST_ARGS)

lint: venv tools ## ruff, mypy, the floors' import contracts and cycles, ansible-lint, helm lint --strict
	$(BIN)/ruff check vgpu sandbox tests bench fuzz
	$(BIN)/ruff format --check vgpu sandbox tests bench fuzz
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(BIN)/python tools/import_cycles.py
	@if [ -d roles ]; then PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/ansible-lint --offline -q playbooks roles; fi
	@if [ -d charts/vgpu ]; then $(VGPU_BIN_DIR)/current/helm lint --strict charts/vgpu; fi

proto: venv ## regenerate the kubelet device-plugin and DRA stubs
	@if [ -f vgpu/deviceplugin/proto.mk ]; then $(MAKE) -f vgpu/deviceplugin/proto.mk BIN=$(BIN); fi
	@if [ -f vgpu/dra/proto.mk ]; then $(MAKE) -f vgpu/dra/proto.mk BIN=$(BIN); fi

demo: setup ## the sandbox, the playbook, sample pods placed and shown (REAL_NODE=1: and a pod on a real node, as root)
	$(BIN)/python -m vgpu_sandbox.demo $(if $(REAL_NODE),--real-node)

bench: setup
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# The tag of the images both builds make: dev (this checkout's; the sandbox's real node imports
# those), or e.g. `make images-docker IMAGE_TAG=0.1.0` for images to push and install with the chart
# (docs/install.md, "Images"). The names are the chart's: docker.io/vgpu/scheduler, docker.io/vgpu/device-plugin.
IMAGE_TAG ?= dev

images: venv native ## the chart's images, the sample and pause as tarballs for containerd (tools/images.sh; root; docs/images.md)
	VGPU_IMAGE_TAG=$(IMAGE_TAG) bash tools/images.sh

images-docker: ## the chart's images from images/*.Dockerfile, with a container engine (docker.io/vgpu/<name>:$(IMAGE_TAG))
	for f in images/*.Dockerfile; do docker build --build-arg HOOK_VERSION=$(IMAGE_TAG) -f $$f -t docker.io/vgpu/$$(basename $$f .Dockerfile):$(IMAGE_TAG) . || exit 1; done

# The README's two commands from nothing in a clean Debian 12 root (docs/fresh-machine.md): root,
# about an hour on two cores. FRESH_ARGS passes options, e.g. FRESH_ARGS='--ref main --keep'.
fresh-check: ## make demo (as a plain user and as root) and make test (as root) in a clean Debian root
	bash tools/fresh-machine-check.sh $(FRESH_ARGS)

clean:
	rm -rf $(VENV) $(VENV)-lock .pytest_cache .mypy_cache .ruff_cache
