# Two entry points, each doing all set-up from a bare Python:
#   make demo        create .venv, install, train the GPT example at ZeRO-3 on 2 CPU ranks
#   make test        create .venv, install (about 1 min), lint (ruff), run the whole test suite (about 5 min on 2 cores)
#   make test-fast   the same without the tests that spawn gloo ranks or are slow (about 1 min)
# Both run two pytest-xdist workers: one runs every test that spawns ranks, in order, while the
# other runs the in-process tests (tests/conftest.py: _xdist_scope), so the 2 cores stay busy
# without two spawns' ranks competing for them.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
TRITON ?= triton==3.7.0
# the CPU wheel of torch 2.13.0 (on this project's machines it lies on disk); GPU users:
#   make TORCH="torch>=2.13" TRITON=triton   (a CUDA build and the triton it pins)
NPROC  ?= 2
STEPS  ?= 300

BIN := $(VENV)/bin

.PHONY: demo test test-fast lint bytecode install clean

# One pip command, not one for torch and one for the rest: pip resolves and checks torch's
# dependencies once (measured in fresh venvs: 26.9 and 36.6 s against 38.4 and 46.9 s).
# pip byte-compiles what it installs one file at a time (about a third of the install);
# compileall does it on every core. A file it cannot compile (torch ships one in Python 3.12
# syntax) is skipped, as pip skips it. Skipped too, as nothing imports them: the packages' own
# tests, pip and setuptools, and every transformers model but Llama (40% of the sources;
# 10.7-15.1 s against 17.9 s on 2 cores)
NO_COMPILE := /tests?/|/site-packages/(pip|setuptools)/|/transformers/models/(?!llama/|auto/)[a-z_0-9]+/
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-compile "$(TORCH)" "$(TRITON)" -e ".[test]"
	$(BIN)/python -m compileall -q -j 0 -x '$(NO_COMPILE)' "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" > /dev/null || true
	touch $@

install: $(BIN)/.installed

demo: install
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node $(NPROC) examples/train_gpt.py --stage 3 --steps $(STEPS)

lint: install
	$(BIN)/python -m ruff check .

# the project's own sources byte-compiled once: where PYTHONDONTWRITEBYTECODE is set (this
# machine), every process that imports zerograph would compile it from source again (0.21 against
# 0.15 CPU s for zerograph.api; tests/test_layers.py's 80 children, 16.7 against 13.1 s). A source
# edited later is compiled in memory as before: Python checks each .pyc against its source.
bytecode: install
	$(BIN)/python -m compileall -q -j 0 zerograph passes tests examples > /dev/null

test: lint bytecode
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile

test-fast: lint bytecode
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not distributed and not slow"

clean:
	rm -rf $(VENV) *.egg-info
	find zerograph passes tests examples -name __pycache__ -prune -exec rm -rf {} +
