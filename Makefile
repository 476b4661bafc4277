# Two commands do all the set-up on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# torchvision (needed by timm, whose vision models the tests build) exists only for torch 2.14.1 here;
# both wheels install from the local disk in under a minute. See "Why torch 2.14.1" in
# docs/contributing.md.
TORCH := torch==2.14.1 torchvision==0.29.1

.PHONY: demo test test-fast lint install clean gpu-check pictures docs

# Two stamps: the demo needs the package, Lightning and the plot extra; the tests need the dev
# tools too. The dev install covers the demo's, so it touches both stamps: `make demo` after
# `make test` installs nothing, `make test` after `make demo` installs `.[dev]`.
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@ $(VENV)/.demo-installed

$(VENV)/.demo-installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[lightning,plot]'
	touch $@

$(VENV)/.docs-installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[docs]'
	touch $@

install: $(VENV)/.installed

# about 2 minutes on 2 CPU cores (the demo says so first, and how long it took last)
demo: $(VENV)/.demo-installed
	$(PY) -m normprobe.demo

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check normprobe tests examples benchmarks docs
	$(VENV)/bin/ruff format --check normprobe tests examples benchmarks docs
	$(VENV)/bin/mypy normprobe

# One pytest worker a core (pytest-xdist), tests handed to whichever is free: on 2 CPU cores the
# suite takes about half its time on one.
test: lint
	$(VENV)/bin/pytest -n auto --dist worksteal --durations=15

# The loop while editing: no lint, and none of the tests marked slow, subprocess or distributed
# (pyproject.toml); about a minute on 2 CPU cores. `make test` runs everything.
test-fast: $(VENV)/.installed
	$(VENV)/bin/pytest -n auto --dist worksteal -m "not slow and not subprocess and not distributed"

# The documentation site (mkdocs.yml, docs/) into site/: a broken link or reference fails it.
# Open site/index.html, or serve it while editing with `.venv/bin/mkdocs serve`.
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The TensorBoard pictures of the README and docs/, from the demo's runs, rendered by headless Chromium.
pictures: demo
	$(PY) docs/make_pictures.py

# On a machine with CUDA: the CUDA tests, the overhead and norm benchmarks, one table (< 8 min).
gpu-check: $(VENV)/.installed
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) runs site .pytest_cache .mypy_cache .ruff_cache
