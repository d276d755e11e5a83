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

from headstart.heads.output_dir import honour_umask


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


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def shard_problem(path: Path, row_lengths: list[int], widths: dict[str, int], dtype: torch.dtype) -> str | None:
    """Why the file at `path` is not a complete shard of rows of `row_lengths` tokens (None: it is one): a header or
    data it cannot read (a truncated or corrupt file), other tensors, row offsets, shapes or dtype. `widths`: each
    state tensor's width, {"final": h} plus {"taps": n*h} where the taps are stored. Reads the header and the
    offsets, not the states."""
    from safetensors import safe_open

    expected = [0]
    for length in row_lengths:
        expected.append(expected[-1] + length)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            keys = set(shard.keys())
            if keys != {"offsets", *widths}:
                return f"it holds the tensors {sorted(keys)}, not {sorted({'offsets', *widths})}"
            if shard.get_tensor("offsets").tolist() != expected:
                return f"its row offsets are not those of its {len(row_lengths)} rows"
            for name, width in widths.items():
                part = shard.get_slice(name)
                if part.get_shape() != [expected[-1], width] or part.get_dtype() != SAFETENSORS_DTYPES.get(dtype):
                    return (f"its {name} is {part.get_dtype()} {part.get_shape()}, not "
                            f"{SAFETENSORS_DTYPES.get(dtype, dtype)} {[expected[-1], width]}")
    except Exception as err:  # safetensors' own error for a cut or garbled file; OSError
        return f"it cannot be read, truncated or corrupt ({' '.join(str(err).split())})"
    return None


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
