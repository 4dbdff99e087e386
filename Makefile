# `make test` is the one command that sets everything up and runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU build of torch lies on these machines' disk; a bare `torch` pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: test install demo bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# Until the embedded default model ships (issue 4), the demo runs on a random tiny target:
# it shows the commands working end to end, not a speedup (a random head accepts ~nothing).
DEMO := runs/demo
demo: install
	$(PY) -m taps.testing $(DEMO)/target
	$(VENV)/bin/taps drafter init --target $(DEMO)/target --out $(DEMO)/drafter --seed 0
	$(VENV)/bin/taps generate --target $(DEMO)/target --prompt "How many clips did Natalia sell?" --max-new-tokens 32 --device cpu --json
	$(VENV)/bin/taps generate --target $(DEMO)/target --drafter $(DEMO)/drafter --prompt "How many clips did Natalia sell?" --max-new-tokens 32 --device cpu --json

bench: install
	$(PY) bench/decode_speed.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
