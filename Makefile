# `make test` and `make train` set everything up on a fresh machine.
# PYTHON=/path/to/python3.12 overrides the search for a Python >= 3.12.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

find_python = $(or $(PYTHON),$(shell ./.ci/find_python))

.PHONY: setup test test-fast lint train clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || { py="$(find_python)"; \
	  test -n "$$py" || { echo "error: no Python >= 3.12 found; install one or pass PYTHON=/path/to/python3.12" >&2; exit 1; }; \
	  echo "creating $(VENV) with $$py"; "$$py" -m venv $(VENV); }
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e ".[data,viz,test]"
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest tests

test-fast: lint
	$(BIN)/python -m pytest tests -m "not slow"

# The default run: the offline German-English corpus (built on first use), then BLEU on its
# test split with beam search. WORKDIR=... trains elsewhere; rerunning resumes.
WORKDIR ?= runs/default
train: $(STAMP)
	$(BIN)/python train.py --config=configs/default.py --workdir=$(WORKDIR)
	$(BIN)/python -m transformer.evaluate --workdir=$(WORKDIR) --split=test

clean:
	rm -rf $(VENV) .cache runs
