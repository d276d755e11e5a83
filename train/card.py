"""The model card (README.md) of a trained heads directory, one builder for every trainer.

Its metadata is huggingface_hub's ModelCardData (heads/card_data.py): base_model (the target's Hub id where one is
known; a local path is no Hub reference), license (the target's, where known), library_name headstart, tags
(speculative-decoding and the method), and the held-out figures of metrics.json as model-index results. The text:
the method, the target, data and training, the per-slot accuracy table, the method's own lines, and how to generate
with the heads.

    card = heads_card(cfg, info, stats, metrics, CardText(title="EAGLE-3 draft", method="...", slot="depth",
                                                          table_caption="...", lines=[...]))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from huggingface_hub import EvalResult, ModelCardData

from headstart.heads.card_data import card_text, target_license
from headstart.heads.export_formats import target_hub_id
USAGE = """\
```python
from headstart.heads.chat import prompt_ids
from headstart.inference.speculator import Speculator

spec = Speculator.from_pretrained("THIS_DIR_OR_REPO")  # loads the target these heads name
out = spec.generate(prompt_ids(spec.tokenizer, "Tell me about owls."), max_new_tokens=128)
print(spec.tokenizer.decode(out.tokens), out.stats.tau)
```
"""


@dataclass
class CardText:
    """What a trainer says of its heads."""

    title: str  # "Medusa heads", "EAGLE-3 draft", ...
    method: str  # the Method line: architecture and options
    slot: str  # what the accuracy table's rows are: head, depth, slot
    table_caption: str  # what slot k of the table predicts
    lines: list[str] = field(default_factory=list)  # the method's own figures, after the table


def card_data(cfg, info, metrics: dict, text: CardText) -> ModelCardData:
    """The card's metadata; metrics.json's held-out figures as model-index results (per slot top-1 and top-5, then
    the method's single figures)."""
    data = f"held-out rows of {cfg.data_dir}"
    results = []
    for k, (top1, top5) in enumerate(zip(metrics["top1"], metrics["top5"])):
        for name, value in (("top-1", top1), ("top-5", top5)):
            results.append(EvalResult(task_type="text-generation", dataset_type="self-distilled", dataset_name=data,
                                      metric_type=f"{name.replace('-', '')}_{text.slot}{k + 1}",
                                      metric_name=f"{text.slot} {k + 1} {name}", metric_value=value))
    for key in ("chain_accepted_tokens", "target_top1", "draft_vocab_coverage", "greedy_agreement"):
        if key in metrics:
            results.append(EvalResult(task_type="text-generation", dataset_type="self-distilled", dataset_name=data,
                                      metric_type=key, metric_name=key.replace("_", " "), metric_value=metrics[key]))
    return ModelCardData(base_model=target_hub_id(info.to_dict()), license=target_license(info.name),
                         library_name="headstart", tags=["speculative-decoding", cfg.method],
                         model_name=f"{text.title} for {info.name}", eval_results=results)


def card_facts(cfg, info, stats: dict, metrics: dict) -> str:
    """The lines every heads directory's card has: target, data, training."""
    return (f"- Target: `{info.name}` ({info.model_type}, hidden {info.hidden_size}, vocab {info.vocab_size}, "
            f"fingerprint `{info.fingerprint}`)\n"
            f"- Data: self-distilled conversations from `{cfg.data_dir}`: {stats['train_rows']} training rows, "
            f"{stats['eval_rows']} held out (the last rows), max_length {cfg.max_length}\n"
            f"- Training: {metrics['steps']} optimizer steps, global batch {metrics['global_batch']} rows, "
            f"lr {cfg.learning_rate}, {getattr(cfg, 'lr_schedule', 'cosine')} with {cfg.warmup_ratio:.0%} warmup, {metrics['train_seconds']:.0f} s")


def accuracy_table(slot: str, metrics: dict) -> str:
    rows = [f"| {k + 1} | {t1:.3f} | {t5:.3f} |" for k, (t1, t5) in enumerate(zip(metrics["top1"], metrics["top5"]))]
    return "\n".join([f"| {slot} | top-1 | top-5 |", "|---|---|---|", *rows])


def heads_card(cfg, info, stats: dict, metrics: dict, text: CardText) -> str:
    """The README.md of a heads directory."""
    lines = "".join(f"{line}\n" for line in text.lines)
    body = f"""# {text.title} for `{info.name}`

- Method: {text.method}
{card_facts(cfg, info, stats, metrics)}

Held-out accuracy ({text.table_caption}):

{accuracy_table(text.slot, metrics)}

{lines}
{USAGE}"""
    return card_text(card_data(cfg, info, metrics, text), body)
