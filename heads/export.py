"""Export a heads directory to what a serving engine loads as is: vLLM, SGLang, or the speculators format.

    python -m headstart.heads.export runs/eagle3-smollm2/heads out/eagle3-vllm --format vllm
    python -m headstart.heads.export runs/eagle3-smollm2/heads out/eagle3-sglang --format sglang
    python -m headstart.heads.export runs/eagle3-smollm2/heads out/eagle3-speculators --format speculators
    python -m headstart.heads.export runs/dflash-smollm2/heads out/dflash-vllm --format vllm
    python -m headstart.heads.export runs/eagle3-smollm2/heads out/eagle3-gguf --format llamacpp   # draft.gguf for llama.cpp

    from headstart.heads.export import export_heads
    export_heads("runs/eagle3-smollm2/heads", "out/eagle3-vllm", "vllm")   # -> Path("out/eagle3-vllm")

The output directory holds `config.json` and `model.safetensors` in the engine's own layout, `README.md` (a model
card: the launch command, the target to pair it with, the acceptance headstart measured), `export.json` (what was
converted, and how) and `.headstart-run.json` (the files the export owns there: heads/output_dir.py). What an engine
cannot represent is refused with the reason (ExportError), never dropped silently (engines skip unknown tensors and
config keys without a word).

The chain length is the one predicted to serve fastest in the format's engine (heads/served_speed.py: the heads'
held-out acceptance over the engine's step-cost curve, measured in the heads directory's engines.json or a
documented prior); when none is predicted to pay, the card and the printed command serve the target without a draft.

What each engine loads, and how a heads directory becomes it: heads/export_formats.py; the model card and
launch commands: heads/export_card.py. `--format llamacpp` writes `draft.gguf` (one GGUF, no config.json or
safetensors) instead: heads/export_gguf.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from headstart.heads.export_card import launch_snippets, model_card, model_free_note
from headstart.heads.export_gguf import GGUF_FILE, llamacpp_card, llamacpp_export, llamacpp_snippets
from headstart.heads.draft_method import resolve
from headstart.heads.export_formats import MASK_EMBEDDING_FILE, ExportError, ExportRequest, looks_like_hub_id, target_hub_id
from headstart.heads.methods import method_of
from headstart.heads.output_dir import (OutputDirError, RunKind, check_output_dir, claim_output_dir, disk_full_is_one_line,
                              honour_umask, owned_entries, read_manifest, record_entries)
from headstart.heads.served_speed import (acceptance_source, choose_draft_length, heldout_metrics, measured_model_free,
                                predict_at, served_record, served_summary)

FORMATS = ("vllm", "sglang", "speculators", "llamacpp")
# whose step costs choose k; llamacpp: "llamacpp-f32" instead when the target GGUF is not quantised
ENGINE_OF_FORMAT = {"vllm": "vllm", "speculators": "vllm", "sglang": "sglang", "llamacpp": "llamacpp"}
# all an export writes (mask_embedding.pt: a DFlash draft's mask-token embedding, the file vLLM reads it from)
EXPORT_FILES = ("config.json", "model.safetensors", "export.json", "README.md", MASK_EMBEDDING_FILE, GGUF_FILE)
MAX_SPECULATIVE_TOKENS = 32  # an EAGLE chain's length in a launch command: far above a useful chain


# ----------------------------------------------------------------------------------------------------- entry point


def export_heads(heads_dir: str | Path, out_dir: str | Path, fmt: str = "vllm", *, target: Any = None,
                 target_id: str | None = None, num_speculative_tokens: int | None = None, repo_id: str | None = None,
                 medusa_full_vocab: bool = False, overwrite: bool = False, target_gguf: str | Path | None = None) -> Path:
    """Write `heads_dir` (a local heads directory or Hub id) to `out_dir` in `fmt` ("vllm", "sglang",
    "speculators"); returns out_dir. ExportError says why a format cannot hold these heads.

    target: the target model (loaded, or a name / path), needed for EAGLE-1 to vLLM (its embedding) and shared-lm_head
    Medusa (its lm_head); default: the target the heads name, checked against their fingerprint.
    target_id: the target's Hub id for the card and the speculators verifier (default: found from the heads' config,
    see `target_hub_id`). num_speculative_tokens: the chain length in the launch command (default: the length with the
    highest predicted served speedup in the format's engine, heads/served_speed.py, up to Medusa's number of heads or
    EAGLE's evaluated depth; DFlash: block_size - 1; when none is predicted to pay, the card shows the target served
    without a draft). repo_id: where the export will be pushed (the card's commands name it).
    target_gguf: llamacpp only, the target's GGUF (its tokenizer goes into the draft; the command serves it); default:
    the embedded target's own GGUF when the heads were trained on it.
    """
    from headstart.heads.directory import read_method, resolve_heads_dir
    from headstart.heads.load import load_heads

    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    source = resolve_heads_dir(heads_dir)
    out = Path(out_dir)
    _check_out_dir(source, out, fmt, overwrite)
    method = read_method(source)
    heads = load_heads(source).float()  # exports are fp32 (the EAGLE-1 fold is computed in float64)
    cfg = heads.config
    declared = method_of(cfg)  # what the heads' method writes for each engine (heads/draft_method.py)
    if fmt not in declared.formats:
        raise ExportError(declared.refusal(fmt))
    metrics = heldout_metrics(source)  # metrics.json (+ chain_acceptance.json), checked: a HeadsLoadError names the field
    k = speculative_tokens(cfg, metrics, num_speculative_tokens)
    engine = ENGINE_OF_FORMAT[fmt]
    if fmt == "llamacpp":
        gguf_draft = llamacpp_export(heads, target, target_gguf)
        engine = gguf_draft.notes["engine"]  # a float or a quantised target GGUF
    k, served = _served_speed(cfg, metrics, source, engine, k, num_speculative_tokens)
    served["acceptance_from"] = acceptance_source(metrics)
    served["model_free"] = measured_model_free(source, engine)
    if target_id is not None and not looks_like_hub_id(target_id):
        raise ExportError(f"target_id {target_id!r:.100} is not a Hugging Face Hub id (owner/name, letters, digits, "
                          "'-', '_', '.'): pass the id the target is published under")
    hub_id = target_id or target_hub_id(cfg.target)
    if fmt == "llamacpp":
        config, tensors, notes = None, {}, gguf_draft.notes
    else:
        request = ExportRequest(fmt, target, k, hub_id or _local_target(cfg.target), medusa_full_vocab)
        config, tensors, notes = resolve(declared.engine_export)(heads, request)

    from safetensors.torch import save_file

    kind = export_run_kind(fmt)
    with claim_output_dir(out, kind), disk_full_is_one_line(out, "free space and rerun; the files an earlier export "
                                                                 "left there are kept"):
        for stale in out.glob(".export-*.tmp"):  # left by an interrupted export
            shutil.rmtree(stale, ignore_errors=True)
        tmp = out / f".export-{uuid.uuid4().hex[:8]}.tmp"  # inside out: nothing is written beside it
        tmp.mkdir()
        try:
            if fmt == "llamacpp":
                gguf_draft.write(tmp / GGUF_FILE)
            else:
                (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            files = {name: tensors.pop(name) for name in list(tensors) if name.endswith(".pt")}  # files of their own
            if tensors:
                save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / "model.safetensors"),
                          metadata={"format": "pt"})
            for name, content in files.items():
                torch.save(content, tmp / name)
            info = {"format": fmt, "method": method, "source": str(heads_dir), "target": cfg.target,
                    "target_hub_id": hub_id, "num_speculative_tokens": k, "served_speed": served, "notes": notes,
                    "headstart_config": {key: v for key, v in asdict(cfg).items() if key != "layer_config"}}
            (tmp / "export.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
            card = llamacpp_card if fmt == "llamacpp" else model_card
            (tmp / "README.md").write_text(card(info, metrics, repo_id or str(out)))
            honour_umask(tmp)  # safetensors writes 0600
            # the files an earlier export wrote (its manifest) are replaced; anything else in out stays
            owned = owned_entries(out, kind)
            for name in EXPORT_FILES:
                if (tmp / name).exists():
                    os.replace(tmp / name, out / name)
                elif name in owned and (out / name).is_file():  # the earlier export had it, this one has not
                    os.remove(out / name)
            record_entries(out, kind, [name for name in EXPORT_FILES if (out / name).exists()])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _local_target(target: dict) -> str | None:
    """The recorded target name when it is an absolute path to an existing model directory (no '..'): the verifier a
    speculators config may name where no Hub id is known; None otherwise."""
    name = str(target.get("name") or "")
    path = Path(name)
    return name if path.is_absolute() and ".." not in path.parts and (path / "config.json").is_file() else None


def speculative_tokens(cfg, metrics: dict, asked: int | None) -> int:
    """The chain length of the launch command: `asked`, else the chain the heads' method fixes (DFlash:
    block_size - 1), a static tree's deepest node (Medusa: its number of heads), or a dynamic tree's evaluated depth
    (EAGLE: metrics.json's top1); bounded by what the heads draft (ExportError otherwise)."""
    if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
        raise ExportError(f"num_speculative_tokens must be a positive integer, got {asked!r:.40}")
    declared = method_of(cfg)
    fixed = declared.engine_chain(cfg)
    if fixed is not None:
        k = asked or fixed
        if k != fixed:
            raise ExportError(f"{declared.title} drafts its whole chain at once: serve it with num_speculative_tokens "
                              f"{fixed}, not {k}; another length changes every slot it was trained on")
        return k
    depth = declared.max_depth(cfg)
    if depth is not None:
        k = asked or depth
        if k > depth:
            raise ExportError(f"an engine runs {declared.title} as a chain of one guess per depth: at most {depth} "
                              f"speculative tokens for these heads, not {k}")
        return k
    k = asked or len(metrics.get("top1") or []) or 3
    if k > MAX_SPECULATIVE_TOKENS:
        raise ExportError(f"num_speculative_tokens {k} is more than the {MAX_SPECULATIVE_TOKENS} an EAGLE chain "
                          "export takes: pass a smaller --num_speculative_tokens")
    return k


def _served_speed(cfg, metrics: dict, source: Path, engine: str, k: int, asked: int | None) -> tuple[int, dict]:
    """(the chain length to export, export.json's `served_speed` record). Unless the user asked for a length, the
    length with the highest predicted speedup in `engine` (heads/served_speed.py's key) among 1..k (k itself where
    the method fixes the chain: DFlash's block); k stays when nothing could be predicted. A user's length is kept,
    with its prediction."""
    method = cfg.method
    if asked is not None:
        return k, served_record(predict_at(metrics, method, engine, source, k), "user")
    candidates = [k] if method_of(cfg).engine_chain(cfg) is not None else range(1, k + 1)
    choice = choose_draft_length(metrics, method, engine, source, candidates)
    return choice.best_k or k, served_record(choice, "export", fallback_k=k)


def export_run_kind(fmt: str) -> RunKind:
    """What an export writes in its output directory (heads/output_dir.py): EXPORT_FILES and its temporary folder."""
    return RunKind(f"export:{fmt}", names=(*EXPORT_FILES, ".export-*.tmp"), markers=("export.json",),
                   flag="output directory")


def _check_out_dir(source: Path, out: Path, fmt: str, overwrite: bool) -> None:
    """Refuse an output dir that is, holds or lies inside the source heads dir; one that is not new, empty or an
    earlier export of this format (heads/output_dir.py: its manifest, or an earlier version's export.json and only
    export files); and an earlier export unless overwrite is set. Nothing is written here."""
    src, dst = source.resolve(), out.resolve()
    if dst == src or src.is_relative_to(dst) or dst.is_relative_to(src):
        where = "is" if dst == src else "holds" if src.is_relative_to(dst) else "lies inside"
        raise ExportError(f"the output directory {out} {where} the heads directory {source} being exported: pass a "
                          f"new directory, e.g. {source.parent / (source.name + '-export')}")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file: pass a directory for the export")
    kind = export_run_kind(fmt)
    if out.is_dir() and read_manifest(out) is None and (out / "export.json").exists():
        info = _read_json(out / "export.json")  # an earlier version's export has no manifest: its export.json tells
        if not {"format", "method", "headstart_config"} <= info.keys() or info["format"] != fmt:
            raise ExportError(f"{out} holds an export.json that is not headstart's {fmt} export, so it is not an earlier "
                              "export: pass a new or empty directory (--overwrite replaces only an earlier export's files)")
    check_output_dir(out, kind)
    if any((out / name).exists() for name in EXPORT_FILES) and not overwrite:
        raise ExportError(f"{out} is not empty (an earlier export): pass overwrite=True (--overwrite) to replace its "
                          "files, or another directory")


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def export_and_push(heads_dir: str | Path, repo_id: str, fmt: str = "vllm", *, out_dir: str | Path | None = None,
                    private: bool = False, **export_kwargs) -> tuple[Path, bool]:
    """For the trainers' `--push_to_hub REPO --push_format FMT`: export `heads_dir` to `out_dir` (default: a sibling
    `<heads_dir>-<fmt>`), then push it with headstart.heads.directory.push_heads_dir. Returns (the exported dir, pushed?);
    a failed push keeps the exported dir and prints how to retry. ExportError when the format cannot hold the heads."""
    from headstart.heads.directory import push_heads_dir

    heads_dir = Path(heads_dir)
    out = Path(out_dir) if out_dir is not None else heads_dir.with_name(f"{heads_dir.name}-{fmt}")
    export_heads(heads_dir, out, fmt, repo_id=repo_id, overwrite=True, **export_kwargs)
    return out, push_heads_dir(out, repo_id, private=private)


def main(argv: list[str] | None = None) -> int:
    from headstart.heads.directory import HeadsLoadError
    from headstart.heads.target import TargetLoadError

    parser = argparse.ArgumentParser(prog="python -m headstart.heads.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("heads_dir", help="a headstart heads directory (or Hub id)")
    parser.add_argument("out_dir", help="the directory the export is written to (new or empty)")
    parser.add_argument("--format", dest="fmt", choices=FORMATS, default="vllm", help="the serving engine's format")
    parser.add_argument("--target", default=None, help="the target (name / path) when the export needs its weights "
                        "(EAGLE-1 for vLLM, shared-lm_head Medusa); default: the one the heads name")
    parser.add_argument("--target_id", default=None, help="the target's Hub id, for the card and the speculators verifier")
    parser.add_argument("--num_speculative_tokens", type=int, default=None,
                        help="tokens drafted per step in the launch command (default: from the heads)")
    parser.add_argument("--repo_id", default=None, help="the Hub repo the export will be pushed to (named in the card)")
    parser.add_argument("--medusa_full_vocab", action="store_true", help="ship the whole lm_head, no token_map")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in out_dir")
    parser.add_argument("--target_gguf", default=None, help="llamacpp: the target's .gguf (its tokenizer goes into "
                        "the draft; the command serves it); default: the embedded target's own GGUF")
    args = parser.parse_args(argv)
    try:
        out = export_heads(args.heads_dir, args.out_dir, args.fmt, target=args.target, target_id=args.target_id,
                           num_speculative_tokens=args.num_speculative_tokens, repo_id=args.repo_id,
                           medusa_full_vocab=args.medusa_full_vocab, overwrite=args.overwrite,
                           target_gguf=args.target_gguf)
    except (ExportError, HeadsLoadError, TargetLoadError, OutputDirError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    info = _read_json(out / "export.json")
    served = info["served_speed"]
    if served["warning"]:
        print(f"warning: {served['warning']}", file=sys.stderr)
    how = "" if served["serve_without_draft"] else "; serve it with"
    print(f"wrote {out} ({args.fmt}); {served_summary(served)}{how}:")
    snippets = llamacpp_snippets if args.fmt == "llamacpp" else launch_snippets
    for line in snippets(info, args.repo_id or str(out)):
        print("  " + line)
    model_free = model_free_note(info)
    if model_free:
        print(model_free)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
