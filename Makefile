# aotgrad: `make demo` and `make test` are the quick start; each installs what it needs.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTHON ?= python3.11
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install bytecode browser chromium vendor demo test lint typecheck pytest bench sweep fuzz models backends compat gpu-check clean

install: $(STAMP) browser bytecode

# Byte-compiles the package, as pip does when it installs a wheel (an editable install does
# not): a fresh process then imports aotgrad without compiling it (issue 29). Up-to-date
# files are skipped, so this is instant after the first run.
bytecode: $(STAMP)
	@$(PY) -m compileall -q src/aotgrad

# The stamp depends on pyproject.toml and constraints.txt, so a second `make install` does
# nothing until the dependencies change. torch goes first and by exact version: the CPU
# wheel is found locally, and pinning it keeps pip from pulling CUDA builds. Everything
# else at the exact versions of constraints.txt (pyproject.toml holds the ranges).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# Debian's chromium, for the HTML report's browser tests (Playwright's own download is not used).
browser:
	@command -v chromium >/dev/null || $(MAKE) chromium

chromium:
	$(SUDO) apt-get install -y --no-install-recommends chromium || \
	  { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends chromium; }

# Fetches the vendored JavaScript again from the npm registry and checks its pinned hash.
vendor:
	rm -rf build/vendor && mkdir -p build/vendor
	cd build/vendor && npm pack --silent @dagrejs/dagre@1.1.4 && tar xzf dagrejs-dagre-1.1.4.tgz
	echo "2cde82baf0b9232c00aa13932945ff92a17fb08c6885a635592330a4c2c567c5  build/vendor/package/dist/dagre.min.js" | sha256sum -c
	cp build/vendor/package/dist/dagre.min.js src/aotgrad/report/vendor/dagre.min.js
	cp build/vendor/package/LICENSE src/aotgrad/report/vendor/dagre.LICENSE

demo: install
	$(VENV)/bin/aotgrad show examples/carry.py:fn

lint: install
	$(VENV)/bin/ruff check src tests examples bench sweep
	$(VENV)/bin/ruff format --check src tests examples bench sweep

typecheck: install
	$(VENV)/bin/mypy

# Then a slice again with every stage boundary checked (Note [Stage checks]).
pytest: install
	$(VENV)/bin/pytest
	AOTGRAD_CHECKS=1 $(VENV)/bin/pytest -q -p no:cacheprovider tests/test_frontends.py tests/test_aliasing.py tests/test_checkpoint.py

test: lint typecheck pytest

bench: install
	$(PY) bench/run.py

# Every OpInfo op with autograd, through aotgrad and PyTorch's aot_function, against eager.
sweep: install
	$(PY) sweep/opinfo_sweep.py --out sweep/report.json

# The differential fuzzer, long: every feature (known-bad ones too), thousands of random programs
# against eager in every idiom (arguments, aot_module, a loss over a global module, trace then
# call, torch.compile, create_graph=True: tests/fuzz_idioms.py), with the stage checks on
# (Note [Stage checks]); prints each distinct failure shrunk to a runnable script. `make test`
# runs a bounded, deterministic slice (tests/test_fuzz.py). FUZZ_SEED=n for another sequence.
FUZZ_EXAMPLES ?= 5000
FUZZ_SEED     ?= 0
fuzz: install
	OMP_NUM_THREADS=1 AOTGRAD_CHECKS=1 $(PY) tests/fuzz_programs.py --examples $(FUZZ_EXAMPLES) --seed $(FUZZ_SEED)

# Every library model x check (tests/test_real_models.py), slow cells included; writes the
# README's model table. `make test` runs only the fast subset.
models: install
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(PY) tests/models_table.py --jobs 2

# Every library model's exported programs run in ONNX Runtime and in IREE against eager
# (docs/backends.md); `make test` runs one model per backend.
backends: install
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -p no:cacheprovider -m 'backends_slow or backends' tests/test_backend_onnxruntime.py tests/test_backend_iree.py tests/test_random_draws.py

# The default suite on another torch / Python of the supported window, in a side environment
# built once outside the repository (tools/compat.sh): make compat TORCH=2.14.1 PYTHON=3.11
compat:
	TORCH=$(TORCH) PYTHON=$(patsubst python%,%,$(PYTHON)) tools/compat.sh

# CUDA checks on a machine with an NVIDIA GPU and the torch it has (prints one table; exits
# nonzero on a mismatch); without a GPU it says so and exits 0.
gpu-check:
	$(if $(wildcard $(PY)),$(PY),python3) tests/gpu_checks.py

clean:
	rm -rf $(VENV) build src/*.egg-info
