"""The frozen target's features, for every trainer that reads them (Medusa, EAGLE-1, EAGLE-3, DFlash).

A row's features are the final-norm hidden state [T, h] (what Medusa heads and EAGLE-1 read; the target's logits are
its lm_head of it) and the taps [T, n*h] = cat(hidden_states[i] for i in feature_layers) (EAGLE-3's input; the final
state itself when feature_layers is [L]). Three sources, chosen by the run config (train/config.py):

- online: one target forward per batch (the default);
- in memory (`feature_cache: true`): every row computed alone once before training and kept (`fill_memory`); N
  processes compute each its N-th share and hand the rows to one another (computed lazily at first use instead, each
  process would come to compute nearly every row, as each epoch's order deals a row to another process);
- on disk (`feature_cache_dir`): sharded safetensors files in `feature_cache_dtype` (default the target's dtype),
  written once before training (resumable: a missing shard is written again), refused when written for other rows,
  target or settings. `build_cache_only` writes the cache and stops. A cache is shared by every trainer with the same
  taps: Medusa and EAGLE-1 (feature_layers [L]) read the same one. Its size (`cache_bytes`) is printed first. With
  `feature_cache_writer: vllm` the trainer writes the rows' token ids instead and scripts/vllm_features.py writes the
  shards from vLLM's hidden states (the files: train/feature_shards.py).

A row computed alone has no padding, so the in-memory and on-disk sources give the same values in any batch layout.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from headstart.heads.output_dir import write_file
from headstart.heads.target import resolve_dtype
from headstart.train.config import ConfigError, TrainRunConfig
from headstart.train.data import DataError, pad_features
from headstart.train.feature_shards import rows_sha256, shard_path, shard_problem, write_rows, write_shard


def final_hidden(target, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The target's last hidden state after the final norm (= HF `hidden_states[-1]`), without the lm_head: [B, T, h]."""
    return target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    feature_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's inputs from the frozen target: taps [B, T, n*h] = cat(hidden_states[i] for i in feature_layers)
    and the final-norm hidden state [B, T, h] (= hidden_states[L]). Taps of [L] alone are the final state itself."""
    if feature_layers == [target.config.get_text_config().num_hidden_layers]:
        final = final_hidden(target, input_ids, attention_mask)
        return final, final
    hidden = target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                                  use_cache=False).hidden_states  # L + 1 tensors [B, T, h]
    return torch.cat([hidden[i] for i in feature_layers], dim=-1), hidden[-1]


class FeatureSource:
    """Per-batch target features, computed online, kept in memory per row, or read from an offline cache on disk.

    Row ids: training rows 0..n_train-1, held-out rows n_train.. (in the order of `rows`).
    `identity`: what the disk cache was written for (cache_identity), None for the other sources.
    """

    def __init__(self, target, rows: list[dict], feature_layers: list[int], mode: str = "online",
                 cache_dir: Path | None = None, cache_dtype: torch.dtype | None = None, shard_rows: int = 64):
        self.target, self.rows, self.layers, self.mode = target, rows, feature_layers, mode
        self.taps_are_final = feature_layers == [target.config.get_text_config().num_hidden_layers]
        self.memory: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cache_dir, self.cache_dtype, self.shard_rows = cache_dir, cache_dtype, shard_rows
        self.identity: dict | None = None
        self._open: dict[int, tuple] = {}

    def row(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(taps [T_r, n*h], final [T_r, h]) of row r, computed alone (no padding: the same values in any batch)."""
        if self.mode == "disk":
            return self._read(r)
        return self.memory[r]  # filled before training (fill_memory)

    def fill_memory(self, accelerator: Accelerator, chunk_rows: int = 16) -> None:
        """Every row in memory on every process, each computed once: process p computes rows p, p + N, ... in rounds
        of chunk_rows; with N > 1 each round's rows go to every process, through the CPU (batch() moves them back to
        the device)."""
        n, p = accelerator.num_processes, accelerator.process_index
        rounds = math.ceil(len(self.rows) / (n * chunk_rows))
        for k in tqdm(range(rounds), desc="target features", disable=not accelerator.is_main_process):
            mine = range(p + k * n * chunk_rows, min(len(self.rows), (k + 1) * n * chunk_rows), n)
            if n == 1:
                self.memory.update((r, self.compute(r)) for r in mine)
                continue
            computed = []
            for r in mine:
                taps, final = self.compute(r)
                computed.append((r, None if self.taps_are_final else taps.cpu(), final.cpu()))
            shares: list = [None] * n
            torch.distributed.all_gather_object(shares, computed)
            for share in shares:
                for r, taps, final in share:
                    self.memory[r] = (final if taps is None else taps, final)

    def compute(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.as_tensor(self.rows[r]["input_ids"], device=self.target.device)[None]
        taps, final = target_features(self.target, ids, torch.ones_like(ids), self.layers)
        return taps[0], final[0]

    def batch(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """batch (collated, with `rows`) -> taps [B, T, n*h], final [B, T, h] on the target's device and dtype."""
        if self.mode == "online":
            return target_features(self.target, batch["input_ids"], batch["attention_mask"], self.layers)
        per_row = [self.row(r) for r in batch["rows"].tolist()]
        T = batch["input_ids"].shape[1]
        device, dtype = batch["input_ids"].device, self.target.dtype
        final = pad_features([f for _, f in per_row], T).to(device, dtype)
        taps = final if self.taps_are_final else pad_features([t for t, _ in per_row], T).to(device, dtype)
        return taps, final

    # ---- offline cache: shard k holds rows [k*S, (k+1)*S): taps (unless they are the final state), final, offsets
    def shard_path(self, k: int) -> Path:
        return shard_path(self.cache_dir, k)

    @property
    def num_shards(self) -> int:
        return math.ceil(len(self.rows) / self.shard_rows)

    def _read(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors import safe_open

        k, j = divmod(r, self.shard_rows)
        if k not in self._open:
            handle = safe_open(str(self.shard_path(k)), framework="pt", device="cpu")
            self._open[k] = (handle, handle.get_tensor("offsets").tolist())
        handle, offsets = self._open[k]
        a, b = offsets[j], offsets[j + 1]
        final = handle.get_slice("final")[a:b]
        taps = final if self.taps_are_final else handle.get_slice("taps")[a:b]
        if not (torch.isfinite(final).all() and (self.taps_are_final or torch.isfinite(taps).all())):
            raise DataError(f"the feature cache file {self.shard_path(k)} holds NaN or infinite values (its row {j}): "
                            "delete that file and rerun (a missing shard is written again); if it comes back, the "
                            "target itself gives non-finite states in this dtype: try --dtype float32")
        return taps, final

    def shard_problem(self, k: int) -> str | None:
        """Why shard k's file is not a complete shard of its rows (train/feature_shards.py shard_problem); None: it is."""
        rows = range(k * self.shard_rows, min((k + 1) * self.shard_rows, len(self.rows)))
        hidden = self.target.config.get_text_config().hidden_size
        widths = {"final": hidden} if self.taps_are_final else {"final": hidden, "taps": len(self.layers) * hidden}
        return shard_problem(self.shard_path(k), [len(self.rows[r]["input_ids"]) for r in rows], widths, self.cache_dtype)

    def write_shard(self, k: int) -> None:
        rows = range(k * self.shard_rows, min((k + 1) * self.shard_rows, len(self.rows)))
        computed = [self.compute(r) for r in rows]
        write_shard(self.shard_path(k), [(None if self.taps_are_final else t, f) for t, f in computed], self.cache_dtype)


def cache_identity(rows: list[dict], info, feature_layers: list[int], dtype: torch.dtype, shard_rows: int) -> dict:
    """What an offline cache was written for; a cache that differs in any field is refused."""
    return {"target_fingerprint": info.fingerprint, "feature_layers": feature_layers, "dtype": str(dtype).split(".")[-1],
            "rows": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows),
            "rows_sha256": rows_sha256([row["input_ids"] for row in rows]), "shard_rows": shard_rows}


def cache_bytes(tokens: int, hidden_size: int, feature_layers: list[int], num_hidden_layers: int,
                dtype: torch.dtype) -> int:
    """Bytes of the on-disk cache's states for `tokens` tokens (the few offset bytes per row aside): every token stores
    the final state [h] and, unless the taps are the final state itself (feature_layers [L]: Medusa, EAGLE-1), its
    n taps [n*h] (EAGLE-3, DFlash). The number of layers only decides that; the size is tokens x (1 + n) x h x bytes."""
    stored_taps = 0 if feature_layers == [num_hidden_layers] else len(feature_layers)
    return tokens * (1 + stored_taps) * hidden_size * dtype.itemsize


def vllm_request(source: FeatureSource) -> dict:
    """What scripts/vllm_features.py needs besides the identity: the target to load (in the dtype headstart computes
    its features in) and its dimensions, so vLLM's states can be checked to be the same model's."""
    config = source.target.config.get_text_config()
    return {"target": source.target.name_or_path, "target_dtype": str(source.target.dtype).split(".")[-1],
            "hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
            "taps_are_final": source.taps_are_final}


def build_feature_cache(source: FeatureSource, identity: dict, hidden: int, accelerator: Accelerator,
                        writer: str = "target", request_only: bool = False) -> None:
    """Write the missing shards (each process writes every N-th shard); reuse the ones already written.
    writer "vllm": write the rows' token ids and the request for scripts/vllm_features.py instead; a run that needs
    the features stops until the shards are there (`request_only`, build_cache_only: return after the request)."""
    cache_dir = source.cache_dir
    meta_file = cache_dir / "cache.json"
    if meta_file.is_file():
        written_for = json.loads(meta_file.read_text())["identity"]
        if written_for != identity:
            diff = sorted(k for k in identity if written_for.get(k) != identity[k])
            raise ConfigError(f"the feature cache in {cache_dir} was written for other rows, target or settings "
                              f"(differs in {diff}); point feature_cache_dir elsewhere or delete it")
    num_layers = source.target.config.get_text_config().num_hidden_layers
    size = cache_bytes(identity["tokens"], hidden, source.layers, num_layers, source.cache_dtype)
    missing = []
    for k in range(source.num_shards):
        problem = source.shard_problem(k) if source.shard_path(k).is_file() else "missing"
        if problem is None:
            continue
        if problem != "missing":  # a file cut by a crash or a full disk, or garbled: this cache's own, written again
            if writer == "vllm":
                raise DataError(f"the feature cache file {source.shard_path(k)} is not a complete shard: {problem}; "
                                "delete it and run scripts/vllm_features.py --cache_dir "
                                f"{cache_dir} again (it writes the missing shards)")
            accelerator.print(f"the feature cache file {source.shard_path(k)} is not a complete shard ({problem}): "
                              "writing it again")
        missing.append(k)
    accelerator.print(f"feature cache {cache_dir}: {identity['rows']} rows, {identity['tokens']} tokens, "
                      f"{size / 2**20:.1f} MiB in {identity['dtype']} ({size / identity['rows'] / 2**20:.2f} MiB per row; "
                      f"{source.num_shards} shards, {len(missing)} to write)")
    if not missing:
        return
    if accelerator.is_main_process:
        cache_dir.mkdir(parents=True, exist_ok=True)
        free, needed = shutil.disk_usage(cache_dir).free, size * len(missing) / source.num_shards
        if needed > free:
            raise DataError(f"the feature cache needs {needed / 2**30:.2f} GiB more; {cache_dir} has {free / 2**30:.2f} GiB "
                            f"free: free space, point feature_cache_dir at a larger disk, store bfloat16 "
                            f"(feature_cache_dtype, half of float32), or compute features online (no feature_cache_dir)")
        meta = {"identity": identity, "bytes_estimate": size}
        if writer == "vllm":
            write_rows(cache_dir, [row["input_ids"] for row in source.rows])
            meta["vllm_request"] = vllm_request(source)
        write_file(meta_file, json.dumps(meta, indent=2))  # never through a link
    accelerator.wait_for_everyone()
    if writer == "vllm":
        command = f"python scripts/vllm_features.py --cache_dir {cache_dir}"
        if request_only:
            accelerator.print(f"feature cache request written; now run, with vLLM's python: {command}")
            return
        raise ConfigError(f"the feature cache {cache_dir} is written by vLLM (feature_cache_writer: vllm) and "
                          f"{len(missing)} of its {source.num_shards} shards are missing: run `{command}` with vLLM's "
                          f"python (docs/training.md, \"Features from vLLM\"), then this command again")
    mine = missing[accelerator.process_index :: accelerator.num_processes]
    for k in tqdm(mine, desc="feature cache", disable=not accelerator.is_main_process):
        source.write_shard(k)
    accelerator.wait_for_everyone()


def open_feature_source(cfg: TrainRunConfig, target, info, rows: list[dict], feature_layers: list[int],
                        accelerator: Accelerator) -> FeatureSource:
    """The source the run config asks for, over `rows` (training rows, then held-out rows); on disk, the missing
    shards are written first."""
    mode = "disk" if cfg.feature_cache_dir else ("memory" if cfg.feature_cache else "online")
    cache_dtype = target.dtype if cfg.feature_cache_dtype == "auto" else resolve_dtype(cfg.feature_cache_dtype)
    source = FeatureSource(target, rows, feature_layers, mode, Path(cfg.feature_cache_dir or "."), cache_dtype,
                           cfg.feature_cache_shard_rows)
    if mode == "disk":
        source.identity = cache_identity(rows, info, feature_layers, cache_dtype, cfg.feature_cache_shard_rows)
        build_feature_cache(source, source.identity, info.hidden_size, accelerator, cfg.feature_cache_writer,
                            request_only=cfg.build_cache_only)
    elif mode == "memory":
        source.fill_memory(accelerator)
    return source
