# Two commands do everything on a fresh machine: `make demo` and `make test`.
# GPU=auto (default) installs the GPU set-up (the `cuda12` extra) where `nvidia-smi -L` lists
# an NVIDIA GPU, else the CPU one; GPU=1 / GPU=0 force the choice (jtbo/info/accelerator.py).
PYTHON ?= python3
GPU ?= auto
VENV := .venv
PY := $(VENV)/bin/python
DETECT := $(PYTHON) -m jtbo.info.accelerator --gpu $(GPU)
ACCEL := $(shell $(DETECT) --print accelerator)
EXTRAS := $(shell $(PYTHON) -m jtbo.info.accelerator --gpu $(if $(filter gpu,$(ACCEL)),1,0) --print extras)
# One stamp per set-up, so switching GPU=... reinstalls.
STAMP := $(VENV)/.installed-$(ACCEL)
EXPECT_GPU := $(if $(filter gpu,$(ACCEL)),1,0)

.PHONY: demo test test-fast install lint

# pip would refuse an older Python with "No matching distribution found for jax": say why.
PYTHON_CHECK := import sys; v = sys.version_info; sys.exit(0 if v >= (3, 12) else \
  'jtbo needs Python >= 3.12 (jax >= 0.11 does); $(PYTHON) is %d.%d.%d: run make PYTHON=python3.12 ...' \
  % v[:3])

$(STAMP): pyproject.toml
	@$(PYTHON) -c "$(PYTHON_CHECK)"
	@echo "jtbo set-up: $(ACCEL) ($(shell $(DETECT) --print reason)); extras [$(EXTRAS)]"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	$(PY) -c "import jax, jax_plugins.xla_cuda12 as p, importlib.metadata as m; \
	  v = m.version('jax-cuda12-plugin'); assert v == jax.__version__, (v, jax.__version__)"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff format --check jtbo tests
	$(VENV)/bin/ruff check jtbo tests
	$(VENV)/bin/lint-imports

demo: $(STAMP)
	JTBO_EXPECT_GPU=$(EXPECT_GPU) $(PY) -m jtbo.demo

test: lint
	$(PY) tools/unused_exports.py
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 --dist loadgroup --durations=25

# The inner loop: every tier but slow, multiprocess and wheel (tests/conftest.py, TIERS).
test-fast: lint
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow and not multiprocess and not wheel" --durations=10
