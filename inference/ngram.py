"""The target's own phrases as a drafting source: an n-gram table of its self-distilled answers.

    table = NgramTable.build(rows)                  # rows: {"input_ids", "loss_mask"} (the training rows)
    table.save(heads_dir / NGRAM_FILE)              # the trainers write it beside the heads
    n, chain = table.draft(context, num_tokens=8)   # the tokens the target most often wrote after the context's tail

For every n-token key (n = 1..max_n) that precedes a target-written token in the rows, the table keeps the token the
target wrote after it most often, or "stop" where that token's share of the key's occurrences is below `min_share`.
A draft extends the context one token at a time by the longest key that occurs, and ends at a stop or where no key
occurs. Like lookup in the context (inference/lookup.py), it drafts from text instead of a network, but from what
the target wrote during self-distillation: a small model repeats its own phrasings ("I'm here to help", code
idioms, answer formats) on prompts it never saw, where the context has nothing to copy. The decode loop verifies
its chain as a branch of the lookup trie (inference/adapt.py), so it is as lossless as any draft.

max_n 4, min_n 1 and min_share 0.3 are what a chain simulation on the tuning split (`mix:train` from row 400) chose
over max_n 6, min_n 2, min_share 0.5 and dropping keys seen once (docs/generation.md).
"""

from __future__ import annotations

import collections
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import torch

from headstart.heads.directory import HeadsLoadError, checked
from headstart.heads.output_dir import honour_umask

NGRAM_FILE = "ngram.safetensors"
STOP = -1  # the key occurs, but no next token reaches min_share
# Entries a table may hold when loaded: a default table (max_tokens 200,000, keys up to 4 tokens) has at most 800,000;
# each costs a few hundred bytes as a Python dict entry, so the cap bounds a loaded table to a few hundred MB
MAX_NGRAM_ENTRIES = 1_000_000
MAX_KEY_TOKENS = 16  # max_n


@dataclass
class NgramConfig:
    max_n: int = 4  # longest key, in tokens
    min_n: int = 1  # shortest key tried before the draft ends
    min_share: float = 0.3  # the most frequent next token's share of its key's occurrences, to be drafted
    max_tokens: int = 200_000  # target-written tokens read (the first rows'): the table stays a few MB


class NgramTable:
    def __init__(self, next_token: dict[tuple[int, ...], int], config: NgramConfig):
        self.next_token = next_token  # key (n tokens) -> the next token, or STOP
        self.config = config

    @classmethod
    def build(cls, rows: Iterable[dict], config: NgramConfig | None = None) -> "NgramTable":
        """From rows with "input_ids" and "loss_mask" (1 = target-written): keys before each target-written token."""
        config = config or NgramConfig()
        counts: dict[tuple[int, ...], collections.Counter] = collections.defaultdict(collections.Counter)
        read = 0
        for row in rows:
            if read >= config.max_tokens:
                break
            ids, mask = list(row["input_ids"]), list(row["loss_mask"])
            for i in range(1, len(ids)):
                if read >= config.max_tokens:
                    break
                if not mask[i]:
                    continue
                read += 1
                for n in range(1, min(config.max_n, i) + 1):
                    counts[tuple(ids[i - n:i])][ids[i]] += 1
        next_token = {}
        for key, counter in counts.items():
            token, count = counter.most_common(1)[0]
            next_token[key] = token if count >= config.min_share * sum(counter.values()) else STOP
        return cls(next_token, config)

    def draft(self, context: list[int], num_tokens: int) -> tuple[int, list[int]]:
        """(n of the key the first token came from, up to num_tokens drafted tokens); (0, []) when none."""
        config, table = self.config, self.next_token
        chain: list[int] = []
        first_n = 0
        tail = list(context[-config.max_n:])  # the last max_n tokens of context + chain
        while len(chain) < num_tokens:
            token = None
            for n in range(len(tail), config.min_n - 1, -1):
                token = table.get(tuple(tail[-n:]))
                if token is not None:
                    first_n = first_n or n
                    break
            if token is None or token == STOP:
                break
            chain.append(token)
            tail = (tail + [token])[-config.max_n:]
        return (first_n if chain else 0), chain

    def save(self, path: str | Path) -> None:
        """keys [M, max_n] (left-padded with -1), next [M], the config in the metadata."""
        from safetensors.torch import save_file

        width = self.config.max_n
        padded = [[-1] * (width - len(key)) + list(key) for key in self.next_token]
        keys = torch.tensor(padded, dtype=torch.int64).reshape(-1, width)  # [M, max_n], also for M = 0
        tokens = torch.tensor(list(self.next_token.values()), dtype=torch.int64)
        save_file({"keys": keys, "next": tokens}, str(path), metadata={"config": json.dumps(asdict(self.config))})
        honour_umask(Path(path))  # safetensors writes 0600, whatever the umask

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None) -> "NgramTable":
        """The table `save` wrote, its token ids inside 0..vocab_size - 1 (when given); anything else, or a table of
        more than MAX_NGRAM_ENTRIES entries (counted from the header, before any tensor is read), is refused with
        HeadsLoadError naming the file."""
        from safetensors import safe_open

        fix = "delete it to decode without it, or retrain the heads to rewrite it"
        try:
            with safe_open(str(path), framework="pt") as f:
                config = cls._config(json.loads((f.metadata() or {})["config"]), path, fix)
                shapes = {name: f.get_slice(name).get_shape() for name in ("keys", "next")}
                dtypes = {name: f.get_slice(name).get_dtype() for name in ("keys", "next")}
                entries = shapes["next"][0] if len(shapes["next"]) == 1 else None  # M
                if entries is None or shapes["keys"] != [entries, config.max_n]:  # keys [M, max_n], next [M]
                    raise ValueError(f"keys {shapes['keys']} and next {shapes['next']} do not fit max_n {config.max_n}")
                if entries > MAX_NGRAM_ENTRIES:
                    raise HeadsLoadError(f"{path} holds {entries} entries, more than the {MAX_NGRAM_ENTRIES} an n-gram "
                                         f"table may have; {fix}")
                if set(dtypes.values()) != {"I64"}:
                    raise HeadsLoadError(f"{path}: keys and next must hold int64 token ids, not {dtypes}; {fix}")
                keys, tokens = f.get_tensor("keys"), f.get_tensor("next")
        except HeadsLoadError:
            raise
        except Exception as err:  # not safetensors, truncated, no config, missing or mis-shaped tensors
            raise HeadsLoadError(f"{path} is not an n-gram table written by headstart ({err.__class__.__name__}: "
                                 f"{str(err).splitlines()[0] if str(err) else ''}); {fix}") from err
        high = (vocab_size if vocab_size is not None else 1 << 62) - 1
        for name, ids in (("keys", keys), ("next", tokens)):
            if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) > high):
                raise HeadsLoadError(f"{path}: {name} holds token ids {int(ids.min())}..{int(ids.max())}, outside "
                                     f"the vocabulary 0..{high} (-1: padding / stop); {fix}")
        next_token = {tuple(t for t in key if t >= 0): token for key, token in zip(keys.tolist(), tokens.tolist())}
        return cls(next_token, config)

    @staticmethod
    def _config(raw: object, path: str | Path, fix: str) -> NgramConfig:
        """The table's config (its safetensors metadata), every field checked."""
        where = f"{path} (metadata config)"
        checked(raw, dict, where, "config", fix=fix)
        unknown = sorted(set(raw) - set(asdict(NgramConfig())))
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}")
        config = NgramConfig(**raw)
        checked(config.max_n, int, where, "max_n", 1, MAX_KEY_TOKENS, fix)
        checked(config.min_n, int, where, "min_n", 1, config.max_n, fix)
        checked(config.min_share, float, where, "min_share", 0.0, 1.0, fix)
        checked(config.max_tokens, int, where, "max_tokens", 0, None, fix)
        return config
