# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install lint

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,aot]'
	$(PY) -c "import jax, jax_plugins.xla_cuda12 as p, importlib.metadata as m; \
	  v = m.version('jax-cuda12-plugin'); assert v == jax.__version__, (v, jax.__version__)"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff format --check jtbo tests
	$(VENV)/bin/ruff check jtbo tests

demo: $(STAMP)
	$(PY) -m jtbo.demo

test: lint
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 --dist loadfile
