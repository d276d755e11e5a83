"""Tree size by measurement (`--tree auto`): time the target's tree forward (and the draft) on this device for a
range of tree sizes and pick the tree with the most expected tokens per second, given the heads' accuracies.

On a CPU a forward over a few more tokens costs more than one, so trees come out small; on a GPU, large.

Timings on a shared machine are noisy, so every size is timed in several rounds, round-robin (the order rotates each
round, so load hits all sizes alike), and each size is judged by the median over rounds of its time divided by the
1-token step timed in the same round: a machine that is uniformly slower leaves the choice unchanged, and a spike in a
minority of rounds moves no median. The medians are then fitted with one non-decreasing curve over all sizes
(monotone_fit). When the rounds disagree too much overall (the median, over every size's samples, of their absolute
deviation from their size's median ratio, relative to it, above `noise_limit`; one erratic size does not decide), the
timings are flagged noisy and the choice falls back to a small default tree (`fallback_nodes` drafted nodes: on a CPU
a verify of a few tokens costs about one step), never to plain decoding. So does a machine where other processes used
more than BUSY_LIMIT CPU cores beyond the ones the timing leaves idle (the usable cores less torch's threads) during
the timings (from /proc/stat): a CPU hog on the timing's cores slows every size alike (the threads wait for each
other), so the rounds agree and only the load tells that the timings are disturbed. A one-thread timing on two cores
leaves one idle, so a one-thread job beside it does not count as busy. `tree.json` records what was measured;
`stale_reason` says when a recorded calibration must not be reused (noisy, no tree, another device, thread count or
linear kernel, an older format).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from headstart.heads.directory import HeadsLoadError, checked, checked_rates, read_metrics
from headstart.heads.output_dir import write_file
from headstart.inference.adapt import PRIOR_STEP_RATIO, StepCost
from headstart.inference.cpu_linear import linear_kernel
from headstart.inference.forward import compact_cache, target_forward
from headstart.inference.medusa import medusa_logits
from headstart.inference.tree import (DEFAULT_ACCURACY, MAX_TREE_NODES, DraftInput, Proposer, best_choices, expected_accept_length,
                            tree_from_choices)

TREE_FILE = "tree.json"
CALIBRATION_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # tree sizes timed; the small ones are the CPU's choices
ROUNDS = 9  # rounds over all sizes; a median over 9 ignores spikes in up to 4 of them
NOISE_LIMIT = 0.15  # above this relative median absolute deviation of all sizes' per-round ratios: too noisy
FALLBACK_NODES = 2  # drafted nodes of the tree used when timings are too noisy (a 3-node tree: cheap on a CPU too)
NEAR_BEST = 0.05  # sizes within this fraction of the best expected tokens/s count as tied (see calibrate_tree)
KEEP_MARGIN = 0.10  # a reference tree is kept unless more than this fraction below the best (see calibrate_tree)
BUSY_LIMIT = 0.5  # CPU cores other processes used on average on the timing's cores: above this, the machine is busy
Timer = Callable[[str, int, Callable[[], None]], float]  # (kind "step" | "draft", tree size, run) -> ms


@dataclass
class TreeCalibration:
    choices: list[list[int]]
    expected_accept_length: float
    step_ms: dict[int, float]  # tree size (root included) -> median 1-token step ms x step_ratio (monotone fit)
    raw_step_ms: dict[int, float]  # the same before the fit
    step_ratio: dict[int, float]  # median over rounds of (size's ms / the 1-token step's ms in the same round)
    spread: dict[int, float]  # relative median absolute deviation of those per-round ratios
    pooled_spread: float  # the same over every size's ratios at once (each relative to its size's median)
    samples_ms: dict[int, list[float]]  # every timing, by size, in round order
    draft_ms: float  # median draft ms of the chosen size (Medusa: all heads, one timing per round)
    draft_samples_ms: dict[int, list[float]]  # by tree size (EAGLE, DFlash) or under 0 (Medusa's one draft)
    draft_ratio: dict[int, float]  # the same keys: median over rounds of draft ms / the round's 1-token step ms
    expected_tokens_per_s: dict[int, float]
    accuracy_source: str  # "heads" (measured, from the heads directory) or "default prior"
    prefix_len: int
    device: str
    linear: str  # the target's linear kernels: inference/cpu_linear.py's linear_kernel label ("default" unswapped)
    threads: int  # torch CPU threads during the timings
    rounds: int
    noisy: bool  # too noisy or machine busy (chosen_by says which): choices is the fallback tree, not the measured best
    noise_limit: float
    chosen_by: str  # "measurement", "measurement, the previous tree kept", "measurement, the prior curve's tree kept",
    # "fallback: too noisy" or "fallback: machine busy"
    other_cores: float | None = None  # CPU cores other processes used on average during the timings (None: unknown)
    idle_cores: float = 0.0  # cores the timing left to other processes (usable cores less torch's threads)
    choices_by_size: dict[int, list[list[int]]] = field(default_factory=dict)
    # the draft's linear weights during the timings: "float32" or "int8" (inference/int8_draft.py)
    draft_weights: str = "float32"

    def fallback_reason(self) -> str:
        """Why the timings were not trusted, for a note to the user."""
        if self.chosen_by == "fallback: machine busy":
            return (f"other processes used {self.other_cores:.1f} CPU cores during the tree timings (> {BUSY_LIMIT} beyond "
                    f"the {self.idle_cores:g} the timing left idle): they measured the machine's load, not the tree "
                    "(rerun when it is quiet; --threads 1 helps)")
        worst = max(self.spread, key=self.spread.get)
        return (f"tree timings too noisy to trust (spread over all sizes {self.pooled_spread:.2f} > "
                f"{self.noise_limit}; the worst size {worst}: {self.spread[worst]:.2f})")

    def to_json(self) -> dict:
        """tree.json's record: every field but choices_by_size, with string keys."""
        record = {k: v for k, v in asdict(self).items() if k != "choices_by_size"}
        return {k: {str(size): x for size, x in v.items()} if isinstance(v, dict) else v for k, v in record.items()}


def write_tree_record(heads_dir: Path, calib: TreeCalibration, accuracy: Sequence[Sequence[float]] | None) -> None:
    """Store a calibration as the heads dir's tree.json (with the accuracies it sized the tree for), as a new file:
    never through a tree.json that is a symbolic link (OutputDirError). OSError when the directory is not writable
    (a read-only Hub cache)."""
    record = calib.to_json()
    if accuracy is not None:
        record["accuracy"] = [list(row) for row in accuracy]
    write_file(heads_dir / TREE_FILE, json.dumps(record, indent=1))


def read_tree_record(path: Path) -> dict | None:
    """A tree.json written by write_tree_record, or None when the file is not one (e.g. a hand-written tree file
    with only "choices" is a tree file, but no calibration record). The numbers headstart reads from a record are
    checked (check_tree_record): a tampered one is a HeadsLoadError naming the field."""
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):  # no such file, unreadable, not JSON
        return None
    if not (isinstance(record, dict) and "choices" in record):
        return None
    return check_tree_record(record, path)


def check_tree_record(record: dict, path: Path) -> dict:
    """A calibration record whose step costs (tree size -> ms, ratio), accuracies and flags are numbers headstart can
    use: sizes 1..MAX_TREE_NODES + 1, times finite and positive, ratios finite and non-negative, rates in 0..1."""
    fix = "delete it (decoding then uses the default tree) or rerun with --tree auto to measure it again"
    for name, low, first in (("step_ms", 1e-9, 1), ("draft_ratio", 0.0, 0)):
        points = record.get(name)
        if points is None:
            continue
        checked(points, dict, path, name, fix=fix)
        if len(points) > MAX_TREE_NODES + 1:
            raise HeadsLoadError(f"{path}: {name} has {len(points)} entries, more than {MAX_TREE_NODES + 1}; {fix}")
        for size, value in points.items():
            if not (isinstance(size, str) and size.isdigit() and first <= int(size) <= MAX_TREE_NODES + 1):
                raise HeadsLoadError(f"{path}: {name} key {size!r:.40} is not a tree size {first}..{MAX_TREE_NODES + 1}; "
                                     f"{fix}")
            checked(value, float, path, f"{name}[{size}]", low, None, fix)
    if record.get("accuracy") is not None:
        checked_rates(record["accuracy"], path, "accuracy", fix)
    for name, kind in (("noisy", bool), ("rounds", int), ("threads", int), ("device", str), ("linear", str),
                       ("draft_weights", str)):
        if record.get(name) is not None:
            checked(record[name], kind, path, name, fix=fix)
    return record


def step_cost_points(record: dict) -> tuple[dict[int, float] | None, dict[int, float] | None]:
    """(step_ms, draft_ratio) of a calibration record (checked by read_tree_record), tree.json's string keys as ints;
    None where absent."""
    step_ms = {int(n): float(ms) for n, ms in (record.get("step_ms") or {}).items()} or None
    draft = {int(n): float(r) for n, r in (record.get("draft_ratio") or {}).items()} or None
    return step_ms, draft


def monotone_fit(times: dict[int, float]) -> dict[int, float]:
    """Least-squares non-decreasing fit of step time vs tree size (pool adjacent violators).

    A bigger tree never costs less; on a busy machine a small size can still time slower than a bigger
    one, which would make big trees look cheap. Pooling such inversions removes that noise.
    """
    sizes = sorted(times)
    blocks: list[list[float]] = []  # [mean, count]
    for size in sizes:
        blocks.append([times[size], 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    fitted: dict[int, float] = {}
    i = 0
    for mean, count in blocks:
        for _ in range(int(count)):
            fitted[sizes[i]] = mean
            i += 1
    return fitted


def time_ms(kind: str, size: int, run: Callable[[], None]) -> float:
    """The default timer: wall milliseconds of one call of `run` (CUDA work included: synchronised around it)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000


def busy_reading() -> tuple[float | None, float]:
    """(CPU seconds the whole machine has used, /proc/stat's all but idle and iowait, minus this process's; wall
    seconds). The first is None where /proc/stat is missing."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None, time.perf_counter()
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    others = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK") - time.process_time()
    return others, time.perf_counter()


def idle_cores_now() -> float:
    """CPU cores this process may run on (its affinity) that torch's threads leave to other processes."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return float(max(usable - torch.get_num_threads(), 0))


def others_cores(before: tuple[float | None, float], after: tuple[float | None, float]) -> float | None:
    """Average CPU cores other processes used between two busy_readings; None when unknown or too short to tell
    (under 1 s: /proc/stat counts in 10 ms ticks)."""
    (cpu0, wall0), (cpu1, wall1) = before, after
    if cpu0 is None or cpu1 is None or wall1 - wall0 < 1.0:
        return None
    return max(cpu1 - cpu0, 0.0) / (wall1 - wall0)


def relative_mad(values: Sequence[float]) -> float:
    """Median absolute deviation from the median, over the median: a spread that ignores a minority of spikes."""
    mid = statistics.median(values)
    return statistics.median(abs(v - mid) for v in values) / mid if mid > 0 else math.inf


def prior_choices(choices_by_size: dict[int, list[list[int]]], accuracy: Sequence[Sequence[float]]) -> list[list[int]]:
    """Of these trees, the one with the most expected accepted tokens per one-token step under the documented prior
    step-cost curve (inference/adapt.py's PRIOR_STEP_RATIO, no draft cost): calibrate_tree's reference tree when no
    earlier calibration is at hand. It depends on the accuracies alone, so every calibration of the same heads
    starts from the same one."""
    cost = StepCost(PRIOR_STEP_RATIO, draft={})
    value = {size: expected_accept_length(c, accuracy) / cost.ratio(size) for size, c in choices_by_size.items()}
    return choices_by_size[max(value, key=value.get)]


def timed_rounds(runs: dict[tuple[str, int], Callable[[], None]], rounds: int, timer: Timer,
                 stop: Callable[[], bool] = lambda: False) -> dict[tuple[str, int], list[float]]:
    """Time every run once per round, round-robin, the order rotated by one each round; ms in round order. After
    each round `stop()` may end the timings early (fewer rounds)."""
    keys = list(runs)
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            samples[key].append(timer(*key, runs[key]))
        if stop():
            break
    return samples


@torch.no_grad()
def calibrate_tree(model: PreTrainedModel, heads: torch.nn.Module, accuracy: Sequence[Sequence[float]] | None = None,
                   sizes: Sequence[int] = CALIBRATION_SIZES, prefix_len: int = 256, repeats: int = ROUNDS,
                   project: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   draft_for: Callable[[list[list[int]]], Callable[[], None]] | None = None,
                   timer: Timer | None = None, noise_limit: float = NOISE_LIMIT,
                   fallback_nodes: int = FALLBACK_NODES,
                   busy_probe: Callable[[], tuple[float | None, float]] | None = None,
                   idle_cores: float | None = None,
                   previous: Sequence[Sequence[int]] | None = None, draft_weights: str = "float32") -> TreeCalibration:
    """Pick the tree size by expected tokens/s = expected accepted length / (verify + draft time). The optimum is
    often flat over several sizes (on a CPU, 3 to 12 nodes within a few percent), so sizes within NEAR_BEST of the
    maximum count as tied; but on a shared host one size's estimate moves by about as much between calibrations, so
    which sizes fall within that band is noise. So a reference tree is kept unless the measurement puts it more than
    KEEP_MARGIN below the best: `previous` (the choices of an earlier calibration on this device,
    from tree.json), else the prior curve's tree (prior_choices: what the documented step-cost curve gives these
    accuracies, inside a CPU's flat optimum), so calibrating again, or from scratch, does not flip the tree between
    near-equal sizes. Where neither is kept (a GPU, where large trees cost about one step), the largest size within
    NEAR_BEST of the best: the model undercounts larger trees, since context lookup (inference/lookup.py) verifies
    chains as long as the tree's node count, which the heads' accuracies do not predict.

    The draft is timed with all Medusa heads, or, with `draft_for(choices) -> run` (EAGLE: drafting a dynamic
    tree of that size and depth), per size. Each size n is timed as one tree forward of n tokens over a cache of
    `prefix_len` tokens (the best tree of n nodes for `accuracy`, so the mask is the real one); accuracy[d][r] is
    the per-(depth, rank) acceptance rate, DEFAULT_ACCURACY (a documented prior, see inference/tree.py) when None.
    `repeats` rounds, round-robin; `timer(kind, size, run) -> ms` (default: wall clock) can be scripted in tests, as can
    `busy_probe` (default: /proc/stat) and `idle_cores` (default: idle_cores_now()). `draft_weights`: the draft's
    linear weights as the heads are now ("float32" or "int8"), recorded (a record of the other is stale).
    Sizes are compared by their per-round ratio to the 1-token step (size 1 is always timed); see the module
    docstring for the noise check and the fallback. About (sizes x repeats) target forwards.
    """
    timer = timer or time_ms
    busy_probe = busy_probe or busy_reading
    idle_cores = idle_cores_now() if idle_cores is None else idle_cores
    sizes = sorted(set(sizes) | {1})
    source = "heads" if accuracy is not None else "default prior"
    accuracy = [list(row) for row in (accuracy if accuracy is not None else DEFAULT_ACCURACY)]
    accuracy = accuracy[: getattr(heads.config, "num_heads", len(accuracy))]
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    vocab = model.get_output_embeddings().weight.shape[0]
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", 4096) or 4096
    prefix_len = max(1, min(prefix_len, limit - max(sizes) - 1))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, prefix_len), generator=gen).to(device)
    cache = DynamicCache()
    _, hidden, _ = target_forward(model, prompt, cache, last_only=True)
    runs: dict[tuple[str, int], Callable[[], None]] = {}
    per_size_choices: dict[int, list[list[int]]] = {}
    for n in sizes:
        choices = best_choices(accuracy, n - 1)
        tree = tree_from_choices(choices)
        tokens = torch.randint(0, vocab, (1, tree.size), generator=gen).to(device)
        mask = tree.attention_mask(prefix_len, dtype=dtype, device=device)
        positions = tree.position_ids(prefix_len, device=device)

        def step(tokens=tokens, mask=mask, positions=positions) -> None:
            target_forward(model, tokens, cache, mask, positions)
            compact_cache(cache, prefix_len, [])  # back to the prefix: every timing sees the same cache

        runs[("step", tree.size)] = step
        per_size_choices[tree.size] = choices
    if draft_for is None:
        runs[("draft", 0)] = lambda: medusa_logits(heads, hidden[0], len(accuracy), project)
    else:
        runs.update({("draft", size): draft_for(per_size_choices[size]) for size in per_size_choices})
    for run in runs.values():
        run()  # warm-up
    before = busy_probe()
    busy_above = idle_cores + BUSY_LIMIT  # other processes' cores beyond which the timings measure the load
    busy_now = lambda: device.type == "cpu" and (others_cores(before, busy_probe()) or 0.0) > busy_above  # noqa: E731
    samples = timed_rounds(runs, max(1, repeats), timer, stop=busy_now)  # a busy machine: no more rounds
    other_cores = others_cores(before, busy_probe())
    one = samples[("step", 1)]  # the 1-token step of each round: every other timing is read relative to it
    ratios = {size: [t / o for t, o in zip(samples[("step", size)], one)] for size in per_size_choices}
    step_ratio = {size: statistics.median(r) for size, r in ratios.items()}
    spread = {size: relative_mad(r) for size, r in ratios.items()}
    deviations = [abs(x / step_ratio[size] - 1) for size, r in ratios.items() if size > 1 for x in r]
    pooled_spread = statistics.median(deviations) if deviations else 0.0
    draft_ratio = {size: statistics.median(t / o for t, o in zip(samples[("draft", size)], one))
                   for kind, size in samples if kind == "draft"}
    one_ms = statistics.median(one)
    fitted = monotone_fit(step_ratio)
    expected: dict[int, float] = {}
    for size, choices in per_size_choices.items():
        draft = draft_ratio[0 if draft_for is None else size] if size > 1 else 0.0  # one node: plain decoding
        expected[size] = 1000.0 * expected_accept_length(choices, accuracy) / (one_ms * (fitted[size] + draft))
    busy = device.type == "cpu" and other_cores is not None and other_cores > busy_above
    noisy = pooled_spread > noise_limit or busy
    kept = ""
    if noisy:
        choices = best_choices(accuracy, fallback_nodes)
    else:  # the previous tree, else the prior curve's, unless KEEP_MARGIN below the best; else the largest near it
        best = max(expected.values())
        near = [per_size_choices[s] for s in sorted(expected) if expected[s] >= (1 - NEAR_BEST) * best]
        keep = [per_size_choices[s] for s in sorted(expected) if expected[s] >= (1 - KEEP_MARGIN) * best]
        references = [("previous", [list(c) for c in previous] if previous is not None else None),
                      ("prior curve's", prior_choices(per_size_choices, accuracy))]
        kept, choices = next(((name, ref) for name, ref in references if ref in keep), ("", near[-1]))
    size = len(choices) + 1
    draft_ms = one_ms * draft_ratio.get(0 if draft_for is None else size, 0.0)
    return TreeCalibration(
        choices=choices, expected_accept_length=expected_accept_length(choices, accuracy),
        step_ms={s: one_ms * r for s, r in fitted.items()}, raw_step_ms={s: one_ms * r for s, r in step_ratio.items()},
        step_ratio=step_ratio, spread=spread, pooled_spread=pooled_spread, samples_ms={s: samples[("step", s)] for s in per_size_choices},
        draft_ms=draft_ms, draft_samples_ms={s: t for (kind, s), t in samples.items() if kind == "draft"},
        draft_ratio=draft_ratio,
        expected_tokens_per_s=expected, accuracy_source=source, prefix_len=prefix_len, device=str(device),
        linear=linear_kernel(model), threads=torch.get_num_threads(), rounds=len(one), noisy=noisy, noise_limit=noise_limit,
        chosen_by=("fallback: machine busy" if busy else "fallback: too noisy" if noisy
                   else f"measurement, the {kept} tree kept" if kept else "measurement"),
        other_cores=other_cores, idle_cores=idle_cores, choices_by_size=per_size_choices, draft_weights=draft_weights)


def read_accuracy(heads_dir: Path) -> list[list[float]] | None:
    """Per-(depth, rank) acceptance rates recorded in the heads directory, or None.

    Rows = heads (depth 1, 2, ...), columns = ranks. Read from `tree.json` ("accuracy"), else from the
    training metrics in `metrics.json` ("rank_accuracy": P(the true token is head k's rank-r guess), as
    train/medusa.py writes it). Used as the Medusa paper does: a path's acceptance probability is the
    product of its nodes' rates (heads treated as independent). Rates that are not numbers in 0..1 are a
    HeadsLoadError naming the file and field.
    """
    record = read_tree_record(heads_dir / TREE_FILE)
    if record is not None and record.get("accuracy") and all(record["accuracy"]):
        return [[float(a) for a in row] for row in record["accuracy"]]
    metrics = read_metrics(heads_dir)
    for key in ("rank_accuracy", "accuracy"):
        acc = metrics.get(key)
        if acc and all(acc):
            return [[float(a) for a in row] for row in acc]
    return None


def draft_timer(model: PreTrainedModel, prefix_len: int,
                proposer_for: Callable[[list[list[int]]], Proposer]) -> Callable[[list[list[int]]], Callable[[], None]]:
    """For a draft whose cost depends on its tree (EAGLE, DFlash): draft_for(choices) -> a callable drafting one
    tree of that shape after a prefix_len context, with a fresh proposer_for(choices) that has committed it (the
    target taps its feature_layers name included)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    context = torch.randint(0, vocab, (prefix_len + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    feature_layers = proposer_for([[0]]).feature_layers
    _, hidden, taps = target_forward(model, torch.tensor([context[:-1]], device=device), DynamicCache(),
                                     feature_layers=feature_layers)

    def draft_for(choices: list[list[int]]) -> Callable[[], None]:
        proposer = proposer_for(choices)
        proposer(DraftInput(hidden=hidden[-1], root=context[-1], context=context, features=taps))  # commit
        return lambda: proposer(DraftInput(hidden=hidden[-1], root=context[-1], context=context))

    return draft_for


def stale_reason(record: dict, device: str, threads: int, linear: str = "default",
                 draft_weights: str = "float32") -> str | None:
    """Why a tree.json calibration record must be measured again on this device, or None if it can be reused."""
    if "rounds" not in record or "noisy" not in record:
        return "it was written by an older calibration (one statistic, no noise check)"
    if record["noisy"]:
        return "its timings were too noisy to trust"
    if not record.get("choices"):
        return "it chose no tree (plain decoding), which one calibration must not settle for good"
    if record.get("device") != device:
        return f"it was measured on {record.get('device')}, not {device}"
    if record.get("linear", "default") != linear:
        return f"it was measured with the {record.get('linear', 'default')} linear kernels, not {linear}"
    if device == "cpu" and record.get("threads") != threads:
        return f"it was measured with {record.get('threads')} torch threads, not {threads}"
    if record.get("draft_weights", "float32") != draft_weights:
        return f"it timed the draft in {record.get('draft_weights', 'float32')}, not {draft_weights}"
    return None
