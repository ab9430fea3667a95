# make demo: create .venv if missing, install moejax, score examples/requests.jsonl with the
#            built-in demo model (a tiny toy trained here, shipped in moejax/demo/weights).
# make test: the same set-up plus the dev and parity extras, then the whole test suite, in
#            PYTEST_WORKERS xdist processes (default 2, the CI machine's cores).
# make test-quick: the same without the tests marked slow (see README, "Tests").
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_OUT ?= out/demo_scores.jsonl

PYTEST_WORKERS ?= 2
# worksteal: each worker starts on one contiguous half of the collected tests (so a
# module's fixtures are mostly built once) and takes tests from the other's tail when done.
PYTEST_XDIST := -n $(PYTEST_WORKERS) --dist worksteal $(CRASH_RERUN)
# A test whose worker process dies under it (a signal: the OOM killer, a crash in native
# code) runs once more on a fresh worker (pytest-rerunfailures' crash recovery); a test
# that fails runs once only: --only-rerun's pattern '(?!)' matches no exception. (CI once
# lost a worker mid-test with no traceback, and the test passed alone and in every
# other run.) The report names every rerun.
CRASH_RERUN := --reruns 1 --only-rerun '(?!)'

.PHONY: demo test test-quick bench-quick clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[dev,parity]"
	touch $(VENV)/.installed $@

demo: $(VENV)/.installed
	@mkdir -p $(dir $(DEMO_OUT))
	$(VENV)/bin/moejax score examples/requests.jsonl -o $(DEMO_OUT)
	@cat $(DEMO_OUT)

# pytest exits 5 when it collected no test: that is a failure here, not a success.
test: $(VENV)/.installed-test
	$(PY) -m pytest $(PYTEST_XDIST); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest ran no tests" >&2; exit 1; fi; exit $$rc

test-quick: $(VENV)/.installed-test
	$(PY) -m pytest $(PYTEST_XDIST) -m "not slow"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-quick: pytest ran no tests" >&2; exit 1; fi; exit $$rc

bench-quick: $(VENV)/.installed-test
	$(PY) -m benchmarks.prefill_cpu --quick

clean:
	rm -rf $(VENV) out .pytest_cache
