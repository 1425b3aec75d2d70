# The two commands: `make up` (the whole stack on this machine) and `make test` (the test suite).
# Both create .venv and install what they need first; only Python 3.11+ must be present.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# xpu, cuda or cpu: the torch build this host needs (worker/hardware.py looks at its GPUs); set it to override.
TORCH_BACKEND ?= $(shell $(PYTHON) worker/hardware.py)
# The Hub kernels (flash_attention_2, use_kernels) exist only for GPUs.
comma := ,
EXTRAS = api,worker,client,test$(if $(filter cpu,$(TORCH_BACKEND)),,$(comma)kernels)

$(STAMP): pyproject.toml worker/hardware.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	@$(PYTHON) worker/hardware.py --explain $(TORCH_BACKEND)
	# torch first, pinned, from the wheel index of the host's backend (PyPI's plain build is the CUDA one).
	$(VENV)/bin/pip install -q "torch==2.13.0" $$($(PYTHON) worker/hardware.py --pip-args $(TORCH_BACKEND))
	$(VENV)/bin/pip install -q -e ".[$(EXTRAS)]"
	# the grammar extra without its dependencies (pyproject.toml says why)
	$(VENV)/bin/pip install -q --no-deps $$($(VENV)/bin/python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['grammar'])")
	$(VENV)/bin/python worker/hardware.py --verify $(TORCH_BACKEND)
	touch $(STAMP)

.PHONY: up test test-slow
up: $(STAMP)
	$(VENV)/bin/xpu-jobs up

test: $(STAMP)
	$(VENV)/bin/ruff check .
	bash .ci/check_deploy.sh
	$(VENV)/bin/python -m pytest -q

# The slow groups: fault injection and the browser. Exit 5 (no test collected) is not a failure while a group is empty.
test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m 'faults or browser' || [ $$? -eq 5 ]
