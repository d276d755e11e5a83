"""The benchmark: plain greedy, HF prompt lookup and draft heads on the same prompts, interleaved, batch 1.

    python -m headstart.inference.bench --heads runs/medusa/heads --prompts mix:heldout+writing --output runs/bench
    headstart bench ...                                           (the same)

run.py: the command and the timing loop; inputs.py: heads directories and prompts; methods.py: each decoding method
as one callable; summary.py: the figures (tau, tokens/s, speedup, spread); report.py: results.md; plot.py:
speedup.png; near_tie.py: why two greedy outputs differ (a near-tie of the target, or not).
"""

from headstart.inference.bench.run import main

__all__ = ["main"]
