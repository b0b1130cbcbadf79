# make demo: install and run the demo;  make test: install and run the whole test suite.
PYTHON ?= $(shell command -v python3.12 >/dev/null 2>&1 && echo "env PYENV_VERSION=3.12.1 python3.12" || echo "$$(pyenv root)/versions/3.12.1/bin/python3.12")
VENV ?= .venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

.PHONY: install demo test
install: $(VENV)/.installed

demo: install
	$(VENV)/bin/jax-msa-runner demo

test: install
	$(VENV)/bin/python -m pytest -q tests
