# `make demo` and `make test` each set everything up on a fresh machine, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml scripts/build_ggml_python.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch from this machine's disk; never a CUDA wheel on a CPU machine.
	$(PY) -m pip install -q torch==2.13.0
	# ggml-python's bindings around the ggml llama.cpp 0.3.36 runs, built as llama.cpp builds it (see the script).
	PYTHON=$(PY) bash scripts/build_ggml_python.sh
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tandem run -p "The three most useful things to know about the ocean are" -n 64 --temp 0.7 --top-p 0.9 --seed 42 --repeat-penalty 1.15

test: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts bench
	$(PY) -m pytest -q -m "not gpu"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts bench

clean:
	rm -rf $(VENV) build src/*.egg-info
