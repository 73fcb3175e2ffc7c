# The two commands of the README: `make run` and `make test`. Everything they need is set up here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SOCKET ?= /tmp/guest-agent.sock

.PHONY: run test lint bench bench-quick clean

$(PY):
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { \
	  echo "python3 -m venv failed; installing python3-venv" >&2; \
	  rm -rf $(VENV); apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null && \
	  $(PYTHON) -m venv $(VENV); }

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,dev]'
	@# Compiled once, as a VM image would ship it: every start skips compiling from source.
	$(PY) -m compileall -q guest_agent
	@touch $(STAMP)

run: $(STAMP)
	@echo "guest-agent listening on unix:$(SOCKET); in another shell:"
	@echo "  $(VENV)/bin/guest-agent-ctl --connect unix:$(SOCKET) ping"
	exec $(PY) -m guest_agent --listen unix:$(SOCKET)

test: $(STAMP)
	$(PY) -m pytest -q
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy --strict guest_agent

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy --strict guest_agent

# The benchmark harness (bench/run.py; docs/benchmarks.md): installs the peers it needs,
# writes bench/results/latest.{md,json}. Extra options: make bench BENCH_ARGS="--placement split".
bench: $(STAMP)
	$(PY) -m bench.run $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(PY) -m bench.run --quick $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
