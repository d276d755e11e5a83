"""train/features.py's in-memory cache over several processes: each row's features computed once, on one process,
and every process holding every row, equal to the row computed alone."""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import tiny_model
from headstart.train.features import FeatureSource

ROWS = [{"input_ids": list(range(1, 4 + r))} for r in range(7)]  # 7 rows of 3-9 tokens
LAYERS = {"taps": [1, 2], "final": [2]}  # EAGLE-3-like taps of two layers; Medusa's final state alone


def fill(rank: int, world: int, port: int, out_dir: str) -> None:
    """One process: fill_memory with chunks of 2 rows, recording which rows this process computed."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    model = tiny_model()
    accelerator = SimpleNamespace(num_processes=world, process_index=rank, is_main_process=rank == 0)
    saved = {}
    for name, layers in LAYERS.items():
        source = FeatureSource(model, ROWS, layers, mode="memory")
        computed, compute = [], source.compute
        source.compute = lambda r, compute=compute, computed=computed: (computed.append(r), compute(r))[1]
        source.fill_memory(accelerator, chunk_rows=2)
        saved[name] = {"computed": computed, "memory": source.memory}
    torch.save(saved, Path(out_dir) / f"{rank}.pt")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_memory_cache_computes_each_row_once_across_processes(tmp_path, one_thread):
    mp.spawn(fill, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    saved = [torch.load(tmp_path / f"{rank}.pt") for rank in range(2)]
    model = tiny_model()  # the check runs on one thread, as the workers did: the same kernels, the same bits
    for name, layers in LAYERS.items():
        computed = [s[name]["computed"] for s in saved]
        assert computed == [[0, 2, 4, 6], [1, 3, 5]]  # process p: rows p, p + 2, ...; none twice
        alone = FeatureSource(model, ROWS, layers, mode="online")
        for s in saved:
            memory = s[name]["memory"]
            assert sorted(memory) == list(range(len(ROWS)))
            for r in range(len(ROWS)):
                taps, final = alone.compute(r)
                assert torch.equal(memory[r][0], taps) and torch.equal(memory[r][1], final)
                assert memory[r][0].shape == (len(ROWS[r]["input_ids"]), 64 * len(layers))
