# make demo: install and run the demo;  make test: install and run the whole test suite.
PYTHON ?= $(shell command -v python3.12 >/dev/null 2>&1 && echo "env PYENV_VERSION=3.12.1 python3.12" || echo "$$(pyenv root)/versions/3.12.1/bin/python3.12")
VENV ?= .venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

.PHONY: install demo test compare-env compare
install: $(VENV)/.installed

demo: install
	$(VENV)/bin/jax-msa-runner demo

# pytest-xdist workers (CI has 2 cores)
TEST_WORKERS ?= 2

test: install compare-env
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=30 tests

# Comparison against vLLM 0.33.0's MiniMax-M3 ops (README, "Comparison with vLLM"): a separate
# Python 3.11 venv with CPU torch + triton (Triton's interpreter runs vLLM's kernels on CPU) and the
# two op files taken from the vllm wheel into the ignored $(VLLM_OPS) with stand-ins for vLLM's
# helpers. The main install stays as it is; `make demo` does not build any of this.
PYTHON311 ?= $(shell command -v python3.11 >/dev/null 2>&1 && echo "env PYENV_VERSION=3.11.7 python3.11" || echo "$$(pyenv root)/versions/3.11.7/bin/python3.11")
VLLM_VENV ?= .venv-vllm
VLLM_OPS ?= .vllm_ops
WHEEL_CACHE ?= $(HOME)/.cache/jax-msa-runner/wheels

$(VLLM_VENV)/.installed: tools/vllm_compare/requirements.txt
	$(PYTHON311) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -r tools/vllm_compare/requirements.txt
	touch $@

$(VLLM_OPS)/MANIFEST.json: tools/vllm_compare/vllm_ops.py | $(VLLM_VENV)/.installed
	ls $(WHEEL_CACHE)/vllm-0.33.0-*.whl >/dev/null 2>&1 || \
	  $(VLLM_VENV)/bin/pip download -q --no-deps vllm==0.33.0 -d $(WHEEL_CACHE)
	$(VLLM_VENV)/bin/python tools/vllm_compare/vllm_ops.py --wheel $(WHEEL_CACHE) --out $(VLLM_OPS)

# transformers 5.23.0 for the parity tests of tests/hf (same venv, its CPU torch).
$(VLLM_VENV)/.hf-installed: tools/hf_reference/requirements.txt $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pip install -q -r tools/hf_reference/requirements.txt
	touch $@

# lm-eval 0.4.13 for the local-completions test (same venv).
$(VLLM_VENV)/.lmeval-installed: tools/lm_eval/requirements.txt $(VLLM_VENV)/.hf-installed
	$(VLLM_VENV)/bin/pip install -q -r tools/lm_eval/requirements.txt
	touch $@

compare-env: $(VLLM_VENV)/.installed $(VLLM_OPS)/MANIFEST.json $(VLLM_VENV)/.hf-installed \
	$(VLLM_VENV)/.lmeval-installed

compare: install compare-env
	$(VENV)/bin/python -m tools.vllm_compare.compare --negative-control
