# metrale developer entry points. `make test` is what CI runs (.ci/run).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.metrale-installed

.PHONY: test lint format venv clean serve plots soak

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 $(PY) -m pytest -q -x --durations=15

# `make serve` serves the bundled model; `make serve MODEL=/path/to/hf-checkpoint PORT=9000
# SERVE_ARGS="--api-key secret"` serves another one.
MODEL ?=
HOST ?= 127.0.0.1
PORT ?= 8888
SERVE_ARGS ?=
BUNDLED_MODEL := metrale/assets/tiny-code/config.json

serve: $(STAMP)
	@if [ -z "$(MODEL)" ] && [ ! -f $(BUNDLED_MODEL) ]; then \
		echo "make serve: the bundled model (metrale/assets/tiny-code) is not there; name a checkpoint: make serve MODEL=/path/to/hf-checkpoint" >&2; \
		exit 2; \
	fi
	HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false $(PY) -m metrale.cli serve $(MODEL) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# The README's benchmark charts (docs/charts/*.png), from every record in bench/records/.
plots: $(STAMP)
	$(PY) -m metrale.cli bench plot bench/records --out docs/charts

# The issue-24 soak (not in CI): the bundled model on the CPU at saturation for DURATION seconds
# with client disconnects, malformed requests and one engine kill; writes a record under
# bench/records/ and fails on a 5xx outside the kill window, a leaked KV block, RSS growth of
# 10% or more, or a KAT change. `make soak DURATION=60 SOAK_ARGS="--out-dir /tmp/soak"`.
DURATION ?= 600
SOAK_ARGS ?=

soak: $(STAMP)
	HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false $(PY) tools/soak.py --duration $(DURATION) $(SOAK_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache
