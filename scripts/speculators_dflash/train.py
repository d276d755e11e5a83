"""speculators 0.9.0's `speculators train` on a CPU, the reference DFlash trainer of docs/measured.md ("DFlash against
the reference trainer"). Every argument goes to `speculators train` unchanged; the installed package is not edited,
three run-time patches stand in for the CUDA device it assumes:
  1. torch.accelerator.synchronize -> no-op (its step timer calls it every logged step; it raises with no accelerator)
  2. speculators.train.trainer.get_local_rank -> "cpu" (the trainer moves the model and every batch to `local_rank`)
  3. Trainer.device_type -> "cpu" (its autocast device; fp32 autocast on a CPU is a no-op)
The rest is the CLI's own flags: --draft-attn-impl sdpa (flex attention compiles for a GPU), --loss-implementation
eager (fused is Triton), --hidden-states-dtype float32, --num-workers 0.

    SPEC_PYTHON scripts/speculators_dflash/train.py --speculator-type dflash --verifier-name-or-path TARGET_DIR ...
"""

import sys

import torch

torch.accelerator.synchronize = lambda *args, **kwargs: None

import speculators.train.trainer as trainer_module  # noqa: E402

trainer_module.get_local_rank = lambda: "cpu"
_trainer_init = trainer_module.Trainer.__init__


def _init_on_cpu(self, *args, **kwargs):
    _trainer_init(self, *args, **kwargs)
    self.device_type = "cpu"


trainer_module.Trainer.__init__ = _init_on_cpu

from speculators.cli import app  # noqa: E402

if __name__ == "__main__":
    sys.argv = ["speculators", "train", *sys.argv[1:]]
    app()
