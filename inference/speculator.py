"""`Speculator`: draft heads (Medusa, EAGLE-1/3 or DFlash) + their target + a tree, behind one `generate` call.

    spec = Speculator.from_pretrained("path/to/heads")           # loads the target named by the heads
    out = spec.generate(input_ids, max_new_tokens=128)            # greedy: identical to model.generate
    out.tokens, out.stats.tau
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import PreTrainedModel

from headstart.heads.chat import stop_token_ids as default_stop_ids
from headstart.heads.directory import HeadsLoadError, resolve_heads_dir
from headstart.heads.draft_method import resolve
from headstart.heads.load import load_heads_and_target
from headstart.heads.methods import UnknownMethodError, method_of
from headstart.heads.output_dir import OutputDirError
from headstart.inference.calibrate import (CALIBRATION_SIZES, ROUNDS, TREE_FILE, Timer, TreeCalibration, calibrate_tree,
                                 draft_timer, read_accuracy, read_tree_record, stale_reason, step_cost_points,
                                 write_tree_record)
from headstart.inference.adapt import AdaptConfig, AdaptivePolicy, StepCost
from headstart.inference.cpu_linear import kernels_of, linear_kernel, projection, use_cpu_linears
from headstart.inference.decode import GenerateOutput, SamplingConfig, SpeculatorError, speculative_generate
from headstart.inference.eagle import dynamic_config_from_choices
from headstart.inference.int8_draft import Int8Linear, Int8Swap, int8_applies
from headstart.inference.lookup import LookupConfig
from headstart.inference.ngram import NGRAM_FILE, NgramTable
from headstart.inference.tree import DynamicTreeConfig, Proposer, Tree, check_choices, default_choices, tree_from_choices

DEFAULT_DYNAMIC_TREE = DynamicTreeConfig(topk=4, depth=4, total_tokens=8)  # as many nodes as the default Medusa tree


class Speculator:
    """Draft heads (Medusa, EAGLE-1/3 or DFlash) + their target + a tree. `generate` is lossless unless
    acceptance='typical'.

    What the heads are and how they draft is their method's declaration (`self.method`, heads/methods.py). Medusa
    heads and a DFlash draft fill a static tree (`self.tree`) from per-depth top-k tokens; an EAGLE draft (a
    `dynamic_tree` method) grows a dynamic tree of `self.dynamic`'s size each step. For Medusa-2 heads (config.adapter) the target is the LoRA-merged one: outputs equal *its*
    greedy decoding / distribution (a target you pass in is copied first). In float32 on a CPU the target's and
    the heads' nn.Linear layers are switched in place to CpuLinears, which take per call the kernel (oneDNN or
    PyTorch's default) measured fastest here for that many rows (inference/cpu_linear.py: the same weights; plain
    decoding on the same model then runs on the same kernels); `cpu_linears=False` leaves them as they are.
    With `draft_int8` (the default) the draft's float32 linear layers on a CPU, and the lm_head rows it scores, run
    from int8 copies (inference/int8_draft.py: the draft only, so outputs stay lossless); `use_draft_int8(False)`
    puts the float32 layers back (inference/acceptance.py does: an engine drafts in its own precision).
    """

    def __init__(self, model: PreTrainedModel, heads: torch.nn.Module, tokenizer=None,
                 tree: str | Sequence[Sequence[int]] | DynamicTreeConfig | None = None, heads_dir: Path | None = None,
                 lookup: bool = True, exact: bool = False, cpu_linears: bool = True, adaptive: bool = True,
                 draft_int8: bool = True):
        kernels = None
        if cpu_linears:  # float32 on a CPU: the target's and the heads' linear layers on the kernels measured fastest here
            kernels = use_cpu_linears(model) or kernels_of(model)
            if kernels is not None:
                use_cpu_linears(heads, kernels)
        self.model = model
        self.heads = heads
        self.tokenizer = tokenizer
        self.heads_dir = heads_dir
        self.lookup = lookup  # also draft from repeats in the context (inference/lookup.py), with the tree's node count
        self.exact = exact  # verify each node with a one-token step's attention (half precision: plain greedy's output)
        self.adaptive = adaptive  # each step verifies what inference/adapt.py expects to pay most (else: self.tree)
        self.adapt_config = AdaptConfig()
        accuracy = read_accuracy(heads_dir) if heads_dir is not None else None  # read once, not per generation
        self.heads_prior = accuracy  # the adaptive policy's prior rates (None: inference/tree.py's DEFAULT_ACCURACY)
        ngram_file = heads_dir / NGRAM_FILE if heads_dir is not None else None
        # the target's phrases from its training rows, drafted beside lookup by the adaptive policy (absent in heads
        # directories written before it)
        self.ngram = (NgramTable.load(ngram_file, heads.config.vocab_size) if ngram_file is not None and ngram_file.is_file()
                      else None)
        try:
            self.method = method_of(heads.config)  # everything method-specific below comes from its declaration
        except UnknownMethodError as err:
            raise SpeculatorError(str(err)) from err
        self.dynamic_tree = self.method.dynamic_tree
        self._new_proposer = resolve(self.method.proposer)
        scored = getattr(heads.config, "draft_vocab_size", 0) or heads.config.vocab_size  # tokens the heads score
        vocab_fraction = scored / heads.config.vocab_size
        self.step_cost = StepCost(None, resolve(self.method.draft_prior)(heads.config, vocab_fraction))
        depth = self.method.max_depth(heads.config)  # None: a dynamic tree drafts any depth
        self.max_depth = DEFAULT_DYNAMIC_TREE.depth if depth is None else depth
        # heads scoring the target's draft-vocabulary lm_head rows (Medusa sharing it, DFlash): sliced and packed once
        self.draft_project = (projection(heads.draft_lm_head_weight(model.get_output_embeddings().weight), kernels)
                              if self.method.scores_target_rows(heads.config) else None)
        self.float_project = self.draft_project
        # the int8 copies of the heads' layers and of draft_project, made when first asked for (none where the
        # layers are not float32 on a CPU); a float32-only Speculator (inference/acceptance.py) never makes them
        self.int8_swap: Int8Swap | None = None
        self.int8_project = None
        self.draft_int8 = False
        self.use_draft_int8(draft_int8)
        self.tree: Tree | None = None  # a static tree's method: the tree
        self.dynamic: DynamicTreeConfig | None = None  # a dynamic tree's method: its size
        self.set_tree(tree)  # see from_pretrained for the values

    def use_draft_int8(self, int8: bool) -> None:
        """Draft from the int8 copies of the heads' linear layers and scored lm_head rows (False: the float32
        originals), from now on; where none applies (not float32 on a CPU) the draft stays as it is."""
        if int8 and self.int8_swap is None:
            project = self.float_project
            self.int8_project = Int8Linear(project) if project is not None and int8_applies(project) else project
            self.int8_swap = Int8Swap(self.heads)
        if self.int8_swap is None:  # never asked for int8: the float32 layers are in place
            return
        int8 = int8 and (bool(self.int8_swap.slots) or self.int8_project is not self.float_project)
        self.int8_swap.use(int8)
        self.draft_project = self.int8_project if int8 else self.float_project
        self.draft_int8 = int8

    @property
    def draft_weights(self) -> str:
        """The draft's linear weights now: "int8" or "float32" (a calibration records it)."""
        return "int8" if self.draft_int8 else "float32"

    @property
    def tree_size(self) -> int:
        """Nodes per verification (root included): the static tree's, or the dynamic tree's total."""
        return self.dynamic.total_tokens if self.dynamic_tree else self.tree.size

    def make_proposer(self) -> Proposer:
        """A fresh proposer of the heads' method drafting the current tree."""
        shape = self.dynamic if self.dynamic_tree else self.tree
        return self._new_proposer(self.heads, self.model, shape, self.draft_project)

    def _proposer_for(self, choices: list[list[int]]) -> Proposer:
        """A fresh proposer drafting the tree of these choices (for timing it)."""
        shape = dynamic_config_from_choices(choices) if self.dynamic_tree else tree_from_choices(choices)
        return self._new_proposer(self.heads, self.model, shape, self.draft_project)

    @classmethod
    def from_pretrained(cls, heads: str | Path, target=None, tokenizer=None,
                        tree: str | Sequence[Sequence[int]] | None = None, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu", draft_int8: bool = True) -> "Speculator":
        """Load heads (local dir or Hub id) and their target, through headstart.heads.load.load_heads_and_target.

        target: None (the target named in the heads' config), a name/path for headstart.heads.target.load_target, a loaded
        model, or a loaded (model, tokenizer, TargetInfo); a target with other weights than the heads were trained
        on is refused. Any loading problem is a SpeculatorError naming it and the fix.
        tree: None (the heads dir's tree.json if any, else the default; a tree.json that headstart.inference.calibrate's
        stale_reason rejects is measured again), "default", "auto" (calibrate on this device and write tree.json),
        a path to a JSON file with "choices", a list of choices, or that list as a JSON string ('[[0], [0, 0]]').
        draft_int8: the draft from int8 copies of its linear layers where they are float32 on a CPU (see the class).
        """
        try:  # the heads, their target, and what the heads dir records (tree.json, metrics.json, ngram.safetensors)
            heads_dir = resolve_heads_dir(heads)
            module, model, tok, _ = load_heads_and_target(heads_dir, target, dtype=dtype, device=device)
            module = module.to(next(model.parameters()).device)
            return cls(model, module, tokenizer or tok, tree=tree, heads_dir=heads_dir, draft_int8=draft_int8)
        except HeadsLoadError as err:
            raise SpeculatorError(str(err)) from err

    def set_tree(self, tree: str | Sequence[Sequence[int]] | DynamicTreeConfig | None) -> None:
        """See `from_pretrained` for the accepted values (EAGLE: also a DynamicTreeConfig)."""
        if isinstance(tree, DynamicTreeConfig):
            if not self.dynamic_tree:
                raise SpeculatorError(f"a dynamic tree needs a draft that grows one (EAGLE); {self.method.title} "
                                      "draft static trees: pass tree choices")
            self.dynamic = tree
            return
        saved = self.heads_dir / TREE_FILE if self.heads_dir is not None else None
        if tree is None:
            tree = "default" if saved is None or not saved.is_file() else self._saved_tree(saved)
        if tree == "default":
            if self.dynamic_tree:
                self.dynamic = DEFAULT_DYNAMIC_TREE
                return
            choices = default_choices(self.max_depth)
        elif tree == "auto":
            self.calibrate()
            return
        elif isinstance(tree, str) and tree.lstrip().startswith("["):  # the choices themselves, as JSON
            try:
                choices = json.loads(tree)
            except json.JSONDecodeError as err:
                raise SpeculatorError(f"tree {tree!r} is not a JSON list of choices, e.g. '[[0], [0, 0]]'") from err
        elif isinstance(tree, (str, Path)):
            file = Path(tree)
            if not file.is_file():
                raise SpeculatorError(f"tree {tree!r} is not 'auto', 'default' or an existing JSON file with 'choices'")
            try:
                choices = json.loads(file.read_text())["choices"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise SpeculatorError(f"{file} is not a tree file: it needs a JSON object with a 'choices' list") from err
        else:
            choices = tree
        cfg = self.heads.config
        try:  # a dynamic tree drafts any depth; a static tree's method declares its deepest (Medusa: its heads)
            choices = check_choices(choices, None if self.dynamic_tree else self.max_depth,
                                    getattr(cfg, "draft_vocab_size", 0) or cfg.vocab_size)
        except ValueError as err:
            raise SpeculatorError(f"tree {tree if isinstance(tree, (str, Path)) else 'choices'}: {err}") from err
        self._use_choices(choices)

    def _saved_tree(self, saved: Path) -> str:
        """The heads dir's tree.json if its calibration can be reused here, else "auto" (measure again)."""
        record = read_tree_record(saved)
        if record is None:
            return str(saved)  # not a calibration record: its own error message, below
        why = self._stale_reason(record)
        if why is None:
            self._use_step_cost(*step_cost_points(record))
            return str(saved)
        print(f"note: not reusing {saved}: {why}; calibrating the tree again", file=sys.stderr)
        return "auto"

    def _use_choices(self, choices: list[list[int]]) -> None:
        if self.dynamic_tree:
            self.dynamic = dynamic_config_from_choices(choices)
        else:
            self.tree = tree_from_choices(choices)

    def calibrate(self, sizes: Sequence[int] = CALIBRATION_SIZES, prefix_len: int = 256, repeats: int = ROUNDS,
                  timer: Timer | None = None) -> TreeCalibration:
        """Time the target on this device, choose the tree, store it as tree.json in the heads dir."""
        accuracy = read_accuracy(self.heads_dir) if self.heads_dir is not None else None
        draft_for = draft_timer(self.model, prefix_len, self._proposer_for) if self.method.timed_per_tree else None
        if self.dynamic_tree and accuracy is not None:
            accuracy = accuracy[: self.max_depth]
        calib = calibrate_tree(self.model, self.heads, accuracy, sizes, prefix_len, repeats, self.draft_project,
                               draft_for, timer, previous=self._previous_choices(),
                               draft_weights=self.draft_weights)
        if calib.noisy:
            print(f"note: {calib.fallback_reason()}; using the fallback tree of {len(calib.choices) + 1} nodes",
                  file=sys.stderr)
        if self.heads_dir is not None:
            try:
                write_tree_record(self.heads_dir, calib, accuracy)
            except (OSError, OutputDirError) as err:  # a read-only Hub cache, a linked tree.json: kept in memory only
                print(f"note: could not write {self.heads_dir / TREE_FILE} ({err})", file=sys.stderr)
        self._use_choices(calib.choices)
        self._use_step_cost(calib.step_ms, calib.draft_ratio)
        return calib

    def _previous_choices(self) -> list[list[int]] | None:
        """The tree an earlier calibration in the heads dir chose on this device (None: none, or not reusable)."""
        record = read_tree_record(self.heads_dir / TREE_FILE) if self.heads_dir is not None else None
        return None if record is None or self._stale_reason(record) is not None else record["choices"]

    def _stale_reason(self, record: dict) -> str | None:
        """Why a tree.json calibration record does not hold for this device, thread count and kernels (None: it does)."""
        return stale_reason(record, str(next(self.model.parameters()).device), torch.get_num_threads(),
                            linear_kernel(self.model), self.draft_weights)

    def _use_step_cost(self, step_ms: dict[int, float] | None, draft_ratio: dict[int, float] | None) -> None:
        """The adaptive policy's step-cost curve from a calibration."""
        if step_ms:
            self.step_cost = StepCost(step_ms, draft_ratio if draft_ratio else self.step_cost.draft)

    def make_policy(self, lookup: bool) -> AdaptivePolicy:
        """A fresh adaptive policy for one generation: the heads' recorded accuracies as its prior, this device's
        step-cost curve when `--tree auto` measured one."""
        return AdaptivePolicy(self.adapt_config, self.heads_prior, self.max_depth, lookup, self.step_cost, self.ngram)

    def generate(self, input_ids: torch.Tensor | Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, acceptance: str = "auto", seed: int | None = None,
                 stop_token_ids: Sequence[int] | None = None, on_tokens: Callable[[list[int]], None] | None = None,
                 proposer: Proposer | None = None, lookup: bool | None = None, exact: bool | None = None,
                 keep_logits: bool = False, adaptive: bool | None = None) -> GenerateOutput:
        """Decode up to max_new_tokens after input_ids ([L] or [1, L]).

        temperature 0: greedy, token-identical to model.generate(do_sample=False) in fp32.
        temperature > 0: lossless sampling (acceptance='auto') or Medusa typical acceptance ('typical', lossy).
        stop_token_ids: default headstart.heads.chat.stop_token_ids (the tokenizer's EOS and the generation config's).
        on_tokens: streaming callback. lookup: draft from repeats in the context too (default self.lookup);
        chains get the tree's node count.
        exact: verify each tree node as a one-token step does (default self.exact; inference/forward.py): in half
        precision greedy output then stays plain greedy's where the device's matmul is row-invariant, at a cost.
        keep_logits: also return the target's logits row behind each token (out.logits; for analysis).
        adaptive: each step verifies a plain step, a heads tree, lookup branches or both, whichever this
        generation's acceptance so far says pays most (inference/adapt.py; default self.adaptive; a proposer
        that is not `resizable` runs without); off: self.tree every step, a lookup chain of its node count instead when
        the context repeats.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise SpeculatorError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if stop_token_ids is None:
            stop_token_ids = default_stop_ids(self.tokenizer, self.model.generation_config)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, acceptance=acceptance)
        use_lookup = self.lookup if lookup is None else lookup
        chain = LookupConfig(num_tokens=self.tree_size - 1) if use_lookup and self.tree_size > 1 else None
        proposer = proposer or self.make_proposer()
        adapt = (self.adaptive if adaptive is None else adaptive) and proposer.resizable
        policy = self.make_policy(use_lookup) if adapt else None
        return speculative_generate(self.model, proposer, input_ids, max_new_tokens, sampling,
                                    stop_token_ids, generator, on_tokens, chain,
                                    self.exact if exact is None else exact, keep_logits, policy)
