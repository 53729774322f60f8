# Two entry points, each doing all set-up from a bare Python:
#   make demo        create .venv, install, train the GPT example at ZeRO-3 on 2 CPU ranks
#   make test        create .venv, install (about 30 s), lint (ruff), run the whole test suite (about 5 min on 2 cores)
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

# uv installs (pip's interface; it resolves, downloads and unpacks in parallel): `make install` in a
# fresh clone with an empty uv cache took 28-36 s against pip's 52-65 s (four and three runs, the
# same packages and versions). uv reads no pip.conf, so it is handed pip's find-links, where this
# project's machines keep the CPU wheel of torch (PIP_FIND_LINKS, else pip's configuration).
# Where uv cannot be installed or fails (no index it can reach, no cache it can write), pip
# installs everything, as before. uv keeps the wheels it unpacked in ~/.cache/uv (UV_CACHE_DIR), which
# `make clean` leaves; `.venv/bin/uv cache clean` empties it.
# Nothing is byte-compiled on install: pip does it one file at a time (about a third of its
# install); compileall does it on every core. A file it cannot compile (torch ships one in Python
# 3.12 syntax) is skipped, as pip skips it. Skipped too, as nothing imports them: the packages' own
# tests, pip and setuptools, and every transformers model but Llama (40% of the sources;
# 10.7-15.1 s against 17.9 s on 2 cores)
NO_COMPILE := /tests?/|/site-packages/(pip|setuptools)/|/transformers/models/(?!llama/|auto/)[a-z_0-9]+/
REQUIREMENTS = "$(TORCH)" "$(TRITON)" -e ".[test]"
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	set --; for link in $${PIP_FIND_LINKS:-$$($(BIN)/pip config get global.find-links 2>/dev/null)}; do \
	  set -- "$$@" --find-links "$$link"; done; \
	{ $(BIN)/pip install --quiet uv && $(BIN)/uv pip install --quiet --python $(BIN)/python "$$@" $(REQUIREMENTS); } || \
	{ echo "uv could not install: pip installs instead (about twice as long)"; \
	  $(BIN)/pip install --quiet --no-compile $(REQUIREMENTS); }
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
