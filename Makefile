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

# The embedded default target ships in models/taps-tiny; its trained drafters do not yet (issue 4),
# so the demo decodes a GSM8K question plainly and with an untrained head: same tokens (lossless),
# no speedup yet (an untrained head accepts almost nothing).
DEMO := runs/demo
TINY := models/taps-tiny/target
QUESTION := "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"
demo: install
	$(VENV)/bin/taps drafter init --target $(TINY) --out $(DEMO)/untrained-drafter --seed 0
	$(VENV)/bin/taps generate --target $(TINY) --prompt $(QUESTION) --max-new-tokens 128 --device cpu
	$(VENV)/bin/taps generate --target $(TINY) --drafter $(DEMO)/untrained-drafter --prompt $(QUESTION) --max-new-tokens 128 --device cpu --json

bench: install
	$(PY) bench/decode_speed.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
