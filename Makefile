VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BASE := $(VENV)/.base

.PHONY: test test-long lint demo install bench clean

# batchctl alone (what `make install` and `make demo` need): no test, benchmark or framework extras
$(BASE): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(BASE)

install: $(BASE)
	@echo "batchctl is $(VENV)/bin/batchctl: run 'source $(VENV)/bin/activate' to put it on PATH"

# made again only when pyproject.toml changes: the venv is reused otherwise
$(STAMP): pyproject.toml
	@echo "make: installing batchctl and its test tools into $(VENV) (a few minutes on a fresh clone; once)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@echo "make: installed; next: the CPU torch and torchdata where their wheels lie on local disk"
	# CPU torch (and torchdata, for StatefulDataLoader) for the adapter tests, only where the torch
	# wheel lies on local disk (never a GB download)
	if ls /opt/wheels/torch-2.13.0* >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0 torchdata==0.11.0; \
	else echo "no local torch wheel: the torch adapter tests will be skipped"; fi
	touch $(STAMP)

test: $(STAMP)
	@echo "make: running the suite (pytest -q; the slowest tests are listed in CONTRIBUTING.md)"
	$(PY) -m pytest -q

# every fault sweep in full (`make test` samples a few moments of each, drawn anew every run)
test-long: $(STAMP)
	BATCHCTL_TEST_LONG=1 $(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check batchctl tests benchmarks examples
	$(VENV)/bin/mypy batchctl

# the README's quick start, from demo/: `cd demo` and its commands run as written
demo: $(BASE)
	$(PY) examples/make_images.py demo/photos --count 200
	$(VENV)/bin/batchctl build demo/photos --batch-size 64 --force
	$(VENV)/bin/batchctl info demo/photos.zarr
	$(VENV)/bin/batchctl preview demo/photos.zarr -o demo/grid.png
	@echo "the photos are in demo/photos; 'cd demo' to try the README's quick start there"
	@echo "batchctl is $(VENV)/bin/batchctl: run 'source $(VENV)/bin/activate' to put it on PATH"

bench: $(STAMP)
	# byte-compiled modules, as an installed package has them (this may run with PYTHONDONTWRITEBYTECODE)
	$(PY) -m compileall -q batchctl
	# LitData, the peer it is compared with, is optional: $(PY) -m pip install torch==2.13.0 litdata
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) demo .pytest_cache .mypy_cache .ruff_cache
