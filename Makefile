# Two commands do everything on a fresh machine with Python 3.11:
#   make train   set up .venv, prepare the stdlib corpus, train the tiny model
#   make test    set up .venv, run the whole test suite (slow tests included)
# `make test-fast` skips tests marked slow.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DATA   := data/stdlib
CONFIG ?= configs/tiny.yaml

.PHONY: setup train test test-fast clean

# torch goes in first and pinned: anything that depends on plain `torch`
# installed before it pulls the multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,plots,hf]'
	touch $(STAMP)

setup: $(STAMP)

$(DATA)/index.json: | $(STAMP)
	$(BIN)/rlt-prepare --source stdlib --out $(DATA) --seq-len 128 --eval-fraction 0.02

train: $(STAMP) $(DATA)/index.json
	WANDB_MODE=$${WANDB_MODE:-offline} $(BIN)/rlt-train $(CONFIG) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not slow"

clean:
	rm -rf $(VENV) runs data/stdlib
