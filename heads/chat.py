"""The target's chat template: the one renderer and the one set of stop tokens for every stage.

Self-distillation renders conversations with it, and generate / bench render prompts with it, so what the
heads are trained on is exactly what they see when serving. The template is rendered to text and tokenized
without special tokens: templates write their own BOS.
"""

from __future__ import annotations


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """messages [{"role", "content"}] -> token ids through the chat template (the assistant's header appended with
    add_generation_prompt). A tokenizer without a template gets the plain concatenation of the contents."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tokenizer, user_turn: str, system: str | None = None) -> list[int]:
    """One user turn (after an optional system message) ready for the assistant's answer."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_turn}]
    return render_chat(tokenizer, messages, add_generation_prompt=True)


def stop_token_ids(tokenizer, generation_config) -> list[int]:
    """The tokens that end an answer: the tokenizer's EOS and the generation config's eos_token_id(s), sorted."""
    ids = {tokenizer.eos_token_id} if tokenizer is not None else set()
    configured = getattr(generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)
