# The README's two commands: `make demo` (the main job, end to end, embedded
# defaults) and `make test` (the whole suite). Both build .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test dev bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,s3,k8s,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/batch-inference demo

test: $(STAMP)
	$(PY) -m pytest -q -ra batch_inference_tests

dev: $(STAMP)
	mkdir -p .dagster_home && cp -n dagster.yaml .dagster_home/dagster.yaml || true
	DAGSTER_HOME=$(CURDIR)/.dagster_home $(VENV)/bin/dagster dev -h 127.0.0.1 -p 3000 -w workspace.yaml

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .demo .dagster_home
