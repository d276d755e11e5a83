"""The offline feature cache's files (train/features.py reads and writes them; scripts/vllm_features.py writes them
from vLLM). Imports only torch, safetensors, the standard library and heads/output_dir.py (standard library only), so
vLLM's own venv can import it too.

A cache directory holds:
- `cache.json`: {"identity": what it was written for (train/features.py cache_identity), "bytes_estimate": ...,
  and, when vLLM writes the shards, "vllm_request": what scripts/vllm_features.py needs};
- `shard-XXXXX.safetensors`, shard k for rows [k*S, (k+1)*S): `final` [tokens, h] (the final-norm state), `taps`
  [tokens, n*h] (absent when the taps are the final state itself) and `offsets` [rows + 1] (row j is a[j]:a[j+1]);
- `rows.safetensors` (only for vLLM): every row's token ids, `input_ids` [tokens] and `offsets` [rows + 1].
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from heads.output_dir import honour_umask


def shard_path(cache_dir: Path, k: int) -> Path:
    return Path(cache_dir) / f"shard-{k:05d}.safetensors"


def write_shard(path: Path, per_row: list[tuple[torch.Tensor | None, torch.Tensor]], dtype: torch.dtype) -> None:
    """One shard from its rows' (taps [T_r, n*h] or None when they are the final state, final [T_r, h]); atomic: a
    shard file is complete or absent, so an interrupted write is redone."""
    from safetensors.torch import save_file

    lengths = [final.shape[0] for _, final in per_row]
    tensors = {"final": torch.cat([final for _, final in per_row]).to("cpu", dtype).contiguous(),
               "offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)}
    if per_row[0][0] is not None:
        tensors["taps"] = torch.cat([taps for taps, _ in per_row]).to("cpu", dtype).contiguous()
    tmp = Path(path).with_suffix(".tmp")
    tmp.unlink(missing_ok=True)  # a new file: never written through a link left there
    save_file(tensors, str(tmp))
    honour_umask(tmp)  # safetensors writes 0600, whatever the umask
    tmp.replace(path)


def rows_sha256(rows_ids: list[list[int]]) -> str:
    """The rows' fingerprint in a cache's identity: their token ids, in order."""
    digest = hashlib.sha256()
    for ids in rows_ids:
        digest.update(json.dumps(ids).encode())
    return digest.hexdigest()[:16]


def write_rows(cache_dir: Path, rows_ids: list[list[int]]) -> None:
    """rows.safetensors: the token ids vLLM runs, row after row."""
    from safetensors.torch import save_file

    lengths = torch.tensor([len(ids) for ids in rows_ids])
    save_file({"input_ids": torch.tensor([t for ids in rows_ids for t in ids], dtype=torch.long),
               "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])},
              str(Path(cache_dir) / "rows.safetensors"))
    honour_umask(Path(cache_dir) / "rows.safetensors")


def read_rows(cache_dir: Path) -> list[list[int]]:
    from safetensors.torch import load_file

    tensors = load_file(str(Path(cache_dir) / "rows.safetensors"))
    ids, offsets = tensors["input_ids"].tolist(), tensors["offsets"].tolist()
    return [ids[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
