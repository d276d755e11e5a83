"""Task families built offline from real text on this machine, for a broad self-distillation mix.

Each family yields PromptRows with a `category`; `split` is train | heldout | all. Rows are split by the *source
text* they are built from (a passage, a conversation's user turns as `chitchat` splits them, a problem), so no
passage, conversation, sentence or problem of a held-out row is ever in a training row.

  passages   instructions over a passage: summarise, list key points, answer a question, extract, rewrite, title;
             from the Python documentation's topics (pydoc_data, PSF licence), long module docstrings of the standard
             library, and chitchat transcripts (dialogue summaries). One in four is a long context (several
             passages, 2,000-8,000 characters) with a question about one of them (retrieval-style).
  translate  an English sentence (chitchat messages, the documentation's prose) into one of six languages
  math       arithmetic word problems from templates with seeded names, items and numbers
  writing    emails, stories, poems, letters and descriptions from templates: the family left out of every
             training mix (evaluation only), to measure how heads generalise to a task they never saw
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import random
import re
import sysconfig
from pathlib import Path

from headstart.heads.prompt_rows import PromptRow, is_heldout, package_file, prompt_key

def in_split(key: str, split: str) -> bool:
    return split in ("", "all") or (split == "heldout") == is_heldout(key)


def _pick(key: str, options: list, salt: str = ""):
    """A fixed choice per key (stable across runs and machines, unlike random with a hash seed)."""
    return options[int(hashlib.sha1((salt + key).encode()).hexdigest(), 16) % len(options)]


# ---------------------------------------------------------------------------------------------
# source texts


@functools.lru_cache(maxsize=1)
def doc_passages() -> list[tuple[str, str, str]]:
    """(split key, heading, text) passages (the key is the folded text: a passage two topics share splits once): the documentation topics cut at paragraph ends into 600-2,500 characters,
    and the standard library's long module docstrings."""
    import pydoc_data.topics

    passages, seen = [], set()  # a paragraph is used once: topics repeat each other (`compound` holds `for`, `if`...)
    for name in sorted(pydoc_data.topics.topics):
        text = pydoc_data.topics.topics[name]
        lines = text.strip().splitlines()
        heading = lines[0].strip() if lines else name
        chunk = []
        for paragraph in re.split(r"\n\s*\n", text.strip()):
            if prompt_key([paragraph]) in seen:
                continue
            seen.add(prompt_key([paragraph]))
            chunk.append(paragraph)
            if sum(len(p) for p in chunk) >= 600:
                body = "\n\n".join(chunk).strip()[:2500]
                passages.append((prompt_key([body]), heading, body))
                chunk = []
        if chunk and sum(len(p) for p in chunk) >= 300:
            body = "\n\n".join(chunk).strip()[:2500]
            passages.append((prompt_key([body]), heading, body))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for file in sorted(stdlib.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(file.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError):
            continue
        if doc and len(doc) >= 400:
            passages.append((prompt_key([doc[:2500]]), f"the {file.stem} module", doc[:2500]))
    return passages


@functools.lru_cache(maxsize=1)
def chitchat_conversations() -> list[tuple[str, list[str]]]:
    """(id, message groups in order, speakers alternating; a group may be empty) of the embedded chitchat conversations.
    A conversation splits by the key of its user turns (the first speaker's groups), as the `chitchat` source does."""
    data = json.loads(package_file("chitchat_dataset", "dataset.json", "chitchat-dataset").read_text())
    conversations = []
    for conv_id in sorted(data):
        groups = [" ".join(m["text"].strip() for m in group if m.get("text", "").strip())
                  for group in data[conv_id].get("messages") or []]
        conversations.append((f"chitchat-{conv_id}", groups))
    return conversations


def chitchat_key(groups: list[str]) -> str:
    return prompt_key([t for t in groups[0::2] if t])


@functools.lru_cache(maxsize=1)
def english_sentences() -> list[tuple[str, str, str]]:
    """(split key, id, sentence): chitchat messages and the documentation's prose sentences, 40-300 characters. The
    split key is the conversation's or passage's, so a held-out conversation or passage gives no training sentence."""
    sentences, seen = [], set()
    for conv_id, groups in chitchat_conversations():
        for i, text in enumerate(groups):
            if 40 <= len(text) <= 300 and text not in seen:
                seen.add(text)
                sentences.append((chitchat_key(groups), f"{conv_id}-{i}", text))
    for p, (key, _, text) in enumerate(doc_passages()):
        for i, sentence in enumerate(re.split(r"(?<=[.!?])\s+", " ".join(text.split()))):
            if 40 <= len(sentence) <= 300 and sentence[0].isupper() and '"' not in sentence and sentence not in seen:
                seen.add(sentence)
                sentences.append((key, f"doc{p}-s{i}", sentence))
    return sentences


# ---------------------------------------------------------------------------------------------
# families


PASSAGE_TASKS = [
    "Summarize the following text in a few sentences.\n\n{text}",
    "{text}\n\nSummarize the text above in one paragraph.",
    "Read this and list its key points as bullet points.\n\n{text}",
    "Here is a passage:\n\n{text}\n\nWhat is the main idea of this passage?",
    "{text}\n\nExplain the text above to a beginner in simple words.",
    "Rewrite the following text so that it is shorter and easier to read.\n\n{text}",
    "Suggest a short title for this text and explain your choice.\n\n{text}",
    "Extract every technical term mentioned in the text below and give a one-line definition of each.\n\n{text}",
    "{text}\n\nAccording to the text, what should a programmer keep in mind about {heading}?",
    "Write three questions a student could answer after reading this text, with their answers.\n\n{text}",
]
DIALOGUE_TASKS = [
    "Summarize this conversation between A and B.\n\n{text}",
    "Here is a chat log:\n\n{text}\n\nWhat are the two people talking about, and how does each of them feel?",
    "{text}\n\nWrite a one-sentence summary of the conversation above.",
    "Read the conversation and list the topics it covers.\n\n{text}",
]
LONG_TASKS = [
    "Use the documents below to answer the question.\n\n{text}\n\nQuestion: what does the documentation say about {heading}?",
    "{text}\n\nBased only on the documents above, explain {heading} in your own words.",
    "Here are some notes:\n\n{text}\n\nWhich of the documents is about {heading}, and what does it say?",
]


def passages(split: str) -> list[PromptRow]:
    docs = [d for d in doc_passages() if in_split(d[0], split)]
    rows = []
    for i, (key, heading, text) in enumerate(docs):
        task = _pick(key, PASSAGE_TASKS)
        rows.append(PromptRow(id=f"passage-{hashlib.sha1(key.encode()).hexdigest()[:12]}", turns=[task.format(text=text, heading=heading)], category="passages"))
        if i % 4 == 3 and len(docs) > 6:  # a long context: this passage among others, asked about this one
            chosen, n = [text], len(text)
            for j in range(1, 6):
                other = docs[(i + 7 * j) % len(docs)][2]
                if n + len(other) > 8000:
                    break
                chosen.insert(min(j, 2), other)  # the passage asked about ends up in the middle, or last
                n += len(other)
            context = [f"Document {d + 1}:\n{body}" for d, body in enumerate(chosen)]
            rows.append(PromptRow(id=f"long-{hashlib.sha1(key.encode()).hexdigest()[:12]}", turns=[_pick(key, LONG_TASKS).format(
                text="\n\n".join(context), heading=heading)], category="long_context"))
    for conv_id, groups in chitchat_conversations():
        key = chitchat_key(groups)
        groups = [g for g in groups if g]
        if len(groups) < 4 or not in_split(key, split) or int(conv_id.split("-")[-1], 16) % 8:
            continue  # one conversation in eight (the chat family uses the rest as they are)
        transcript = "\n".join(f"{'AB'[j % 2]}: {g}" for j, g in enumerate(groups[:12]))
        rows.append(PromptRow(id=f"dialogue-{conv_id}", turns=[_pick(conv_id, DIALOGUE_TASKS).format(text=transcript)],
                              category="passages"))
    rows.sort(key=lambda r: hashlib.sha1(r.id.encode()).hexdigest())
    return rows


LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Chinese"]
TRANSLATE_TASKS = [
    "Translate this sentence into {lang}: {text}",
    "Translate to {lang}:\n\n{text}",
    "How would you say this in {lang}? \"{text}\"",
    "{text}\n\nTranslate the sentence above into {lang}.",
]


def translate(split: str) -> list[PromptRow]:
    rows = []
    for split_key, key, sentence in english_sentences():
        if in_split(split_key, split):
            task = _pick(key, TRANSLATE_TASKS)
            rows.append(PromptRow(id=f"translate-{key}", category="translate",
                                  turns=[task.format(lang=_pick(key, LANGUAGES, "lang"), text=sentence)]))
    rows.sort(key=lambda r: hashlib.sha1(r.id.encode()).hexdigest())
    return rows


NAMES = ["Ava", "Ben", "Chen", "Dara", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kemal", "Lena", "Maya",
         "Nico", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara"]
ITEMS = ["apples", "pencils", "stickers", "books", "marbles", "cookies", "stamps", "tickets", "shells", "cards"]
MATH_TEMPLATES = [
    "{a} has {x} {item}. {b} gives {a} {y} more, and then {a} gives away {z}. How many {item} does {a} have now?",
    "A shop sells {item} at {p} dollars each. {a} buys {x} of them and pays with a {bill}-dollar bill. How much change "
    "does {a} get?",
    "{a} reads {x} pages a day. The book has {n} pages. How many days does {a} need to finish it?",
    "A train travels at {s} kilometres per hour for {h} hours, then at {t} kilometres per hour for {k} hours. How far "
    "does it travel in total?",
    "{a} saves {x} dollars every week. After {w} weeks {a} spends {z} dollars on a gift. How much money is left?",
    "There are {n} students in a class, and {q} percent of them walk to school. How many students do not walk?",
    "{a} and {b} share {n} {item} in the ratio {r1}:{r2}. How many {item} does each of them get?",
    "A rectangle is {x} centimetres long and {y} centimetres wide. What are its area and its perimeter?",
    "{a} is {x} years old. {b} is {y} years older than {a}. In {w} years, what will be the sum of their ages?",
    "A recipe needs {x} grams of flour for {y} cookies. How much flour is needed for {n} cookies?",
    "{a} buys {x} packs of {item} with {y} in each pack and shares them equally among {k} friends. How many does each "
    "friend get, and how many are left over?",
    "A tank holds {n} litres. It is filled at {x} litres per minute and drains at {y} litres per minute. How long does "
    "it take to fill the empty tank?",
]
MATH_PROBLEMS = 6000


def math_problems(split: str) -> list[PromptRow]:
    rows = []
    for i in range(MATH_PROBLEMS):
        rng = random.Random(f"math-{i}")
        template = MATH_TEMPLATES[i % len(MATH_TEMPLATES)]
        a, b = rng.sample(NAMES, 2)
        x, y = rng.randint(3, 60), rng.randint(2, 40)
        values = dict(a=a, b=b, x=x, y=y, z=rng.randint(1, x), item=rng.choice(ITEMS), p=rng.randint(2, 9),
                      bill=rng.choice([50, 100]), n=rng.randint(60, 600), s=rng.randint(40, 120), t=rng.randint(40, 120),
                      h=rng.randint(1, 5), k=rng.randint(2, 6), w=rng.randint(2, 12), q=rng.choice([10, 20, 25, 40, 60, 75]),
                      r1=rng.randint(1, 4), r2=rng.randint(1, 5))
        if "drains" in template:
            values["x"] = values["y"] + rng.randint(1, 20)
        problem = template.format(**values)
        ask = rng.choice(["", " Explain your reasoning step by step.", " Show your work.", ""])
        if in_split(problem, split):
            rows.append(PromptRow(id=f"math-{i}", turns=[problem + ask], category="math"))
    return rows


WRITING_TASKS = [
    "Write a short email to {who} asking to move our meeting about {topic} to next week.",
    "Write a short story about {who} who discovers something unexpected about {topic}.",
    "Write a poem about {topic}.",
    "Write a polite letter to {who} complaining about a problem with {topic}.",
    "Write a product description for a new app that helps people with {topic}.",
    "Write a short speech for {who} about why {topic} matters.",
    "Write a blog post introduction about {topic} for {who}.",
    "Write a thank-you note to {who} for their help with {topic}.",
]
WHO = ["a neighbour", "my manager", "a teacher", "a customer", "an old friend", "the city council", "a new colleague",
       "my landlord", "a librarian", "a team of volunteers"]
TOPICS = ["gardening", "the summer festival", "a broken bicycle", "learning to cook", "the new library", "saving energy",
          "a lost cat", "public transport", "a weekend hike", "moving to a new city", "the school play", "rainy days",
          "a birthday surprise", "recycling", "an old photograph", "the night sky"]


def writing(split: str) -> list[PromptRow]:
    rows = []
    for t, task in enumerate(WRITING_TASKS):
        for w, who in enumerate(WHO):
            for topic in TOPICS:
                key = f"writing-{t}-{w}-{topic}"
                if "{who}" not in task and w:
                    continue
                if in_split(key, split):
                    rows.append(PromptRow(id=key, turns=[task.format(who=who, topic=topic)], category="writing"))
    rows.sort(key=lambda r: hashlib.sha1(r.id.encode()).hexdigest())
    return rows


FAMILIES = {"passages": passages, "translate": translate, "math": math_problems, "writing": writing}
EVAL_ONLY = {"writing"}  # left out of every training mix
