"""A drafting method added from outside the package, through the one interface (docs/design.md "Add a drafting
method"): a toy declared in this file alone, registered once, trained by train/loop.py's shared run, decoded by
the Speculator (greedy: plain greedy's tokens), and its heads directory saved and loaded by heads/load.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from headstart.heads.directory import HeadsModule
from headstart.heads.draft_method import DraftMethod
from headstart.heads.load import load_heads, load_heads_and_target
from headstart.heads.methods import UnknownMethodError, method_of, register
from headstart.inference.speculator import Speculator
from headstart.inference.tree import DraftInput, Proposer, Tree, static_tree_tokens
from headstart.train.config import TrainRunConfig
from headstart.train.loop import accumulate, finish_run, start_run, train
from test_eagle_train import write_greedy_selfdistilled


@dataclass
class ToyConfig:
    """The toy's config.json: one linear layer from the target's last hidden state to `depth` next tokens."""

    hidden_size: int
    vocab_size: int
    depth: int = 2
    method: str = "toy"
    target: dict = field(default_factory=dict)  # headstart.heads.target.TargetInfo.to_dict() of the target


class ToyHeads(HeadsModule):
    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = config
        self.proj = nn.Linear(config.hidden_size, config.depth * config.vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., h] -> logits [..., depth, V]: slot d scores the token d + 2 after the hidden state's."""
        return self.proj(hidden).unflatten(-1, (self.config.depth, self.config.vocab_size))


class ToyProposer(Proposer):
    """Fills a static tree: depth d, rank r gets slot d - 1's rank-r token (stateless, one tree)."""

    def __init__(self, heads: ToyHeads, tree: Tree):
        self.heads, self.tree = heads, tree

    @torch.no_grad()
    def __call__(self, draft: DraftInput) -> tuple[Tree, torch.Tensor]:
        ranks = max(self.tree.ranks) + 1
        topk = self.heads(draft.hidden).topk(ranks, dim=-1).indices  # [depth, ranks]
        return self.tree, static_tree_tokens(self.tree, draft.root, topk[: self.tree.max_depth])


TOY = register(DraftMethod(
    title="toy heads", card_name="Toy", names=("toy",), config_class=ToyConfig, module_class=ToyHeads,
    proposer=lambda heads, model, tree, project: ToyProposer(heads, tree),
    draft_prior=lambda config, draft_vocab_fraction: {0: 0.01},
    max_depth=lambda config: config.depth,
))


def toy_step(run, heads: ToyHeads):
    """One optimizer step's loss: slot d's cross-entropy against the token d + 2 positions later, where the target
    wrote it."""
    depth = heads.config.depth

    def step_fn(model, micro: list[dict], step: int) -> dict:
        def loss_fn(batch: dict):
            with torch.no_grad():
                hidden = run.target(batch["input_ids"], attention_mask=batch["attention_mask"],
                                    output_hidden_states=True).hidden_states[-1]  # [B, T, h] final-norm
            logits = model(hidden)  # [B, T, depth, V]
            losses = []
            for d in range(depth):
                shift = d + 2
                labels = batch["input_ids"][:, shift:]  # [B, T - shift]
                mask = batch["loss_mask"][:, shift:].bool()
                scored = logits[:, :-shift, d][mask]  # [n, V]
                losses.append(nn.functional.cross_entropy(scored, labels[mask]))
            loss = torch.stack(losses).mean() / len(micro)
            return loss, {"loss": loss.detach()}

        return {name: value.item() for name, value in accumulate(run.accelerator, model, micro, loss_fn).items()}

    return step_fn


def test_a_toy_method_trains_decodes_and_round_trips(tiny_target_dir, tmp_path):
    assert method_of("toy") is TOY and method_of(ToyConfig(8, 8)) is TOY
    with pytest.raises(UnknownMethodError, match="unknown drafting method 'nope'"):
        method_of("nope")
    data = write_greedy_selfdistilled(tmp_path / "sd", tiny_target_dir)
    cfg = TrainRunConfig(method="toy", target=str(tiny_target_dir), data_dir=str(data), output_dir=str(tmp_path / "toy"),
                         per_device_batch_size=2, eval_rows=4, max_steps=4, learning_rate=1e-2, num_prompts=None)
    run = start_run(cfg)
    torch.manual_seed(cfg.seed)
    heads = ToyHeads(ToyConfig(run.info.hidden_size, run.info.vocab_size, target=run.info.to_dict()))
    before = {n: p.detach().clone() for n, p in heads.named_parameters()}
    trained = train(run, heads, [{"params": list(heads.parameters())}], toy_step(run, heads))
    toy = run.accelerator.unwrap_model(trained.model).eval()
    assert any(not torch.equal(p, before[n]) for n, p in toy.named_parameters())  # it learned something
    metrics = {"top1": [0.0] * toy.config.depth, "top5": [0.0] * toy.config.depth}
    finish_run(run, trained, metrics, toy.save_pretrained, lambda *facts: "# toy heads\n", "slot")

    heads_dir = tmp_path / "toy" / "heads"
    loaded = load_heads(heads_dir, run.info)
    assert isinstance(loaded, ToyHeads) and loaded.config == toy.config
    assert all(torch.equal(p, loaded.state_dict()[n]) for n, p in toy.state_dict().items())

    spec = Speculator.from_pretrained(heads_dir, target=str(tiny_target_dir))
    assert spec.method is TOY and spec.max_depth == 2 and spec.tree.max_depth == 2
    model = load_heads_and_target(heads_dir)[1]
    for prompt in ([5, 9, 11, 40, 7], [60, 3, 3, 3, 18, 22, 90]):
        ids = torch.tensor([prompt])
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        out = spec.generate(prompt, 24, stop_token_ids=[])
        assert out.tokens == plain
        assert out.stats.decode_forwards < 24  # the toy's drafts were accepted at times
