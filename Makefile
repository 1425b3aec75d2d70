# The two commands: `make up` (the whole stack on this machine) and `make test` (the test suite).
# Both create .venv and install what they need first; only Python 3.11+ must be present.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch first, pinned: on this machine pip takes the CPU wheel; elsewhere a plain install pulls a CUDA build.
	$(VENV)/bin/pip install -q "torch==2.13.0"
	$(VENV)/bin/pip install -q -e ".[api,worker,test]"
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
