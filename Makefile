# One command sets up and runs the demo; one sets up and runs the tests CI runs (test-all: every test).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.quantship-installed

.PHONY: demo test test-all bench-smoke install lint bench clean

demo: $(STAMP)
	$(VENV)/bin/quantship demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=25

# everything: the slow end-to-end tests and the bench smoke runs too (hours on a slow 2-core machine)
test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "" --durations=25

# every bench script end to end in its --smoke mode, each in a fresh process (30-60 min on 2 cores)
bench-smoke: $(STAMP)
	$(PY) -m pytest -q -n 2 -m bench_smoke tests/test_bench_smoke.py

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[fastai,test,real]'
	$(PY) -m pip install -q --no-deps facenet-pytorch==2.6.0
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench docs

bench: $(STAMP)
	$(PY) bench/latency.py
	$(PY) bench/pipeline.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
