# Two entry points: `make serve` (every role on this machine, SmolLM2-135M-Instruct) and
# `make test`. Both create .venv and install what they need; torch is pinned and installed
# first so pip never pulls a CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
# Debian packages the tests use for real (command:package): a C compiler for the CPU kernels and
# torch.compile, iproute2 for the network-namespace test, Redis for the shared rate limits,
# kubectl (with kustomize) to render the Kubernetes overlays, promtool (Debian's prometheus) to
# check the alert rules. Installed when a command is missing; no test skips for want of one.
SYSTEM_TOOLS := cc:gcc ip:iproute2 redis-server:redis-server kubectl:kubectl promtool:prometheus
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv test lint typecheck serve clean

$(STAMP): pyproject.toml
	@missing=""; for t in $(SYSTEM_TOOLS); do \
	  command -v "$${t%%:*}" >/dev/null || missing="$$missing $${t#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing"; \
	  $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q $$missing; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[test,serve]"
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy, strict, on every package (pyproject.toml [tool.mypy]). The folders install as
# pdserve.<name> (package-dir), which mypy cannot map: it reads them through a tree of links
# that mirrors the installed names.
TYPED := -p pdserve.protocol -p pdserve.models -p pdserve.runtime -p pdserve.engine \
	-p pdserve.kvtransfer -p pdserve.worker -p pdserve.prefill -p pdserve.decode \
	-p pdserve.coordinator -p pdserve.gateway -p pdserve.launch -p pdserve.bench -p pdserve.sim \
	-m pdserve.fair_queue -m pdserve.envs
TYPE_TREE := $(VENV)/typecheck
typecheck: $(STAMP)
	@rm -rf $(TYPE_TREE)/pdserve && mkdir -p $(TYPE_TREE)/pdserve
	@for d in $$(sed -n 's/^"pdserve\.\([a-z_]*\)" = "\([a-z_]*\)"$$/\2/p' pyproject.toml); do \
	  ln -s "$(CURDIR)/$$d" "$(TYPE_TREE)/pdserve/$$d"; done
	@ln -s "$(CURDIR)"/pdserve/*.py "$(TYPE_TREE)/pdserve/"
	cd $(TYPE_TREE) && MYPYPATH=. "$(CURDIR)/$(VENV)/bin/mypy" \
	  --config-file "$(CURDIR)/pyproject.toml" --python-executable "$(CURDIR)/$(PY)" $(TYPED)

# Two pytest workers (pytest-xdist), each module's tests on one of them so a module's cluster
# is started once, the slow modules first in tests/conftest.py's order: 701 s on this 2-core
# machine (2026-11-30 00:38, 2,342 tests; 1,069-1,311 s the day before: README).
PYTEST_WORKERS ?= 2
test: $(STAMP) typecheck
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder

serve: $(STAMP)
	$(VENV)/bin/pdserve serve

clean:
	rm -rf $(VENV) .pytest_cache
