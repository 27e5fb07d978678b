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
	@echo "== A healthy fake 8x H100 node:  gpu-npd diagnose --nvml fake:h100-sxm-8"
	@$(BIN)/gpu-npd diagnose --nvml fake:h100-sxm-8 --node-name demo-node | tee $(VENV)/demo-healthy.txt; echo "(exit code $${PIPESTATUS[0]})"
	@echo
	@echo "== The same node with GPU 5's PCIe link trained at x8:  gpu-npd diagnose --nvml fake:h100-sxm-8-pcie-x8"
	@$(BIN)/gpu-npd diagnose --nvml fake:h100-sxm-8-pcie-x8 --node-name demo-node | tee $(VENV)/demo-x8.txt; echo "(exit code $${PIPESTATUS[0]})"
	@echo
	@echo "== What changed between the two (diff, first line skipped):"
	@diff <(sed 1d $(VENV)/demo-healthy.txt) <(sed 1d $(VENV)/demo-x8.txt) || true

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
