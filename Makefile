# `make test` and `make train` set everything up on a fresh machine; `make` alone lists the
# targets. PYTHON=/path/to/python3.12 overrides the search for a Python >= 3.12.
.DEFAULT_GOAL := help
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

find_python = $(or $(PYTHON),$(shell ./.ci/find_python))

.PHONY: help setup test test-fast lint docs docs-serve train clean

setup: $(STAMP)

help:
	@echo "make setup      create $(VENV) (a Python >= 3.12; PYTHON=... to choose) and install everything"
	@echo "make test       lint and run every test (make test-fast: skip the slow ones)"
	@echo "make lint       ruff check ."
	@echo "make docs       build the documentation site into site/ (mkdocs build --strict)"
	@echo "                (make docs-serve: the same at http://127.0.0.1:8000, rebuilt on edit)"
	@echo "make train      train the offline German-English default, then score its test split"
	@echo "                (WORKDIR=runs/default; rerunning resumes)"
	@echo "make clean      remove $(VENV), .cache, runs/ and site/"

# Without a Python >= 3.12, uv (when installed) fetches one; otherwise the error says how to get one.
# constraints.txt pins every package to the versions the suite last passed with.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || { py="$(find_python)"; \
	  if [ -z "$$py" ] && command -v uv >/dev/null 2>&1; then \
	    echo "no Python >= 3.12 found: uv python install 3.12"; \
	    uv python install 3.12 && py=$$(uv python find 3.12); fi; \
	  test -n "$$py" || { ./.ci/find_python --help-install >&2; exit 1; }; \
	  echo "creating $(VENV) with $$py"; "$$py" -m venv $(VENV); }
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -c constraints.txt -e ".[data,viz,test,docs,torch,tpu,quantize,eval]"
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

# The site: usage pages, results pages and the API reference from the docstrings (mkdocs.yml).
# --strict fails on a broken link, a missing page or image, and a docstring it cannot read.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# Tests run in TEST_WORKERS processes (pytest-xdist), one a CPU core up to 4 (each fakes 8 CPU
# devices and may start train.py processes: more would crowd the memory of a small machine).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
test: lint
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --durations=25

test-fast: lint
	$(BIN)/python -m pytest tests -m "not slow" -n $(TEST_WORKERS)

# The default run: the offline German-English corpus (built on first use), then BLEU on its
# test split with beam search, in the same process (its ETA counts both). WORKDIR=... trains
# elsewhere; rerunning resumes (a finished run: scores it again).
WORKDIR ?= runs/default
train: $(STAMP)
	$(BIN)/python train.py --config=configs/default.py --workdir=$(WORKDIR) --score_split=test
	@echo "results: $(WORKDIR)/metrics.jsonl (figures), $(WORKDIR)/eval/ (translations), $(WORKDIR)/checkpoints/"
	@echo "try it:  echo 'See you tomorrow.' | $(BIN)/python -m transformer.translate --workdir=$(WORKDIR)"

clean:
	rm -rf $(VENV) .cache runs site
