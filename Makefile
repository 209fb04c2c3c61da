# gptoss-max — the first two targets are the README's two commands.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
MODEL   ?=
HOST    ?= 127.0.0.1
PORT    ?= 8000
STAMP   := $(VENV)/.installed

.PHONY: serve test install lint typecheck clean tiny

serve: $(STAMP)
	$(BIN)/gptoss-max serve $(if $(MODEL),--model $(MODEL),--model auto) --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts bench

typecheck: $(STAMP)
	$(BIN)/mypy

tiny: $(STAMP)
	$(BIN)/gptoss-max make-tiny data/tiny

clean:
	rm -rf build data/tiny .pytest_cache .mypy_cache .ruff_cache
