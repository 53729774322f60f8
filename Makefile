# Two entry points, each doing all set-up from a bare Python:
#   make demo        create .venv, install, train the GPT example at ZeRO-3 on 2 CPU ranks
#   make test        create .venv, install, lint (ruff), build the docs site (warnings as errors), run the whole test suite
#   make test-fast   lint and the tests that neither spawn gloo ranks nor are marked slow
# (and `make docs`: build the docs site, mkdocs.yml and docs/, into site/, warnings as errors;
#  `make gpu-check`: on a machine with one CUDA GPU, the real models under zerograph and FSDP2, in minutes;
#  without CUDA it says it skipped and succeeds).
#   make stress      (not part of `make test`) the spawned trainings run STRESS_ITERATIONS times under
#                    glibc's heap checks (tests/stress.py); aborts counted, their logs in STRESS_LOGS/
# test and test-fast run two pytest-xdist workers: one runs every test that spawns ranks, in order, while the
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

.PHONY: demo test test-fast stress lint bytecode docs install clean gpu-check

# uv installs (pip's interface; it resolves, downloads and unpacks in parallel, so a fresh install
# takes less time than pip's, with the same packages and versions). uv reads no pip.conf, so it is handed pip's find-links, where this
# project's machines keep the CPU wheel of torch (PIP_FIND_LINKS, else pip's configuration).
# Where uv cannot be installed or fails (no index it can reach, no cache it can write), pip
# installs everything, as before. uv keeps the wheels it unpacked in ~/.cache/uv (UV_CACHE_DIR), which
# `make clean` leaves; `.venv/bin/uv cache clean` empties it.
# Nothing is byte-compiled on install: pip does it one file at a time; compileall does it on every core. A file it cannot compile (torch ships one in Python
# 3.12 syntax) is skipped, as pip skips it. Skipped too, as nothing imports them: the packages' own
# tests, pip and setuptools, and every transformers model but Llama (a large share of the sources)
NO_COMPILE := /tests?/|/site-packages/(pip|setuptools)/|/transformers/models/(?!llama/|auto/)[a-z_0-9]+/
REQUIREMENTS = "$(TORCH)" "$(TRITON)" -e ".[test]"
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	set --; for link in $${PIP_FIND_LINKS:-$$($(BIN)/pip config get global.find-links 2>/dev/null)}; do \
	  set -- "$$@" --find-links "$$link"; done; \
	{ $(BIN)/pip install --quiet uv && $(BIN)/uv pip install --quiet --python $(BIN)/python "$$@" $(REQUIREMENTS); } || \
	{ echo "uv could not install: pip installs instead (slower)"; \
	  $(BIN)/pip install --quiet --no-compile $(REQUIREMENTS); }
	$(BIN)/python -m compileall -q -j 0 -x '$(NO_COMPILE)' "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" > /dev/null || true
	touch $@

install: $(BIN)/.installed

demo: install
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node $(NPROC) examples/train_gpt.py --stage 3 --steps $(STEPS)

lint: install
	$(BIN)/python -m ruff check .

# the project's own sources byte-compiled once: where PYTHONDONTWRITEBYTECODE is set (this
# machine), every process that imports zerograph would compile it from source again, and the tests
# start many such processes. A source edited later is compiled in memory as before: Python checks
# each .pyc against its source.
bytecode: install
	$(BIN)/python -m compileall -q -j 0 zerograph passes tests examples > /dev/null

# the documentation site, warnings as errors (mkdocs.yml: mkdocstrings renders the API reference
# from the docstrings, so a docstring that names a parameter its function lacks fails here);
# NO_MKDOCS_2_WARNING quiets mkdocs-material's banner about MkDocs 2.0, which is not a build warning.
# Not --quiet: it silences the warnings themselves, and --strict then passes whatever they say
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

test: lint bytecode docs
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile

test-fast: lint bytecode
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not distributed and not slow"

# examples/gpu_check.py: step time, max_memory_allocated and templated units of HF GPT-2, HF Llama and
# the torchtitan-shaped Llama, zerograph (default build, Inductor lowering) beside FSDP2 (eager, compiled)
gpu-check: install
	$(BIN)/python examples/gpu_check.py

# the stress lane: every test file that spawns ranks (or STRESS_TESTS: files or node ids, and
# STRESS_K: a pytest -k expression), STRESS_ITERATIONS times each under MALLOC_PERTURB_, the
# iterations alternating glibc's checking allocator (MALLOC_CHECK_=3) and its own (STRESS_MALLOC:
# alternate, check or plain; tests/stress.py says why), with STRESS_ENV's NAME=VALUE pairs added
# (e.g. ZEROGRAPH_DEBUG_COLLECTIVES=1); STRESS_BESIDE=1 runs the in-process tests in a loop beside
# them (the full suite's load); exits non-zero when a run aborted or failed
STRESS_ITERATIONS ?= 3
STRESS_TESTS ?=
STRESS_K ?=
STRESS_LOGS ?= stress-logs
STRESS_ENV ?=
STRESS_MALLOC ?= alternate
STRESS_BESIDE ?=
stress: bytecode
	$(BIN)/python -m tests.stress --iterations $(STRESS_ITERATIONS) --log-dir $(STRESS_LOGS) --malloc $(STRESS_MALLOC) \
	  $(if $(STRESS_TESTS),--tests $(STRESS_TESTS)) $(if $(STRESS_K),-k "$(STRESS_K)") \
	  $(foreach e,$(STRESS_ENV),--env $(e)) $(if $(STRESS_BESIDE),--beside-in-process)

clean:
	rm -rf $(VENV) *.egg-info site
	find zerograph passes tests examples -name __pycache__ -prune -exec rm -rf {} +
