# Everything a fresh machine needs: `make test` and `make demo` create .venv and install into it.
SHELL := bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install test demo clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

demo: install
	@echo "== gpu-npd run on a fake 8x H100 node, reporting to an in-process Kubernetes API emulator."
	@echo "== XID 79 hits GPU 3 after a few seconds; then the node reboots. Conditions and events as they change:"
	@$(BIN)/gpu-npd demo

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
