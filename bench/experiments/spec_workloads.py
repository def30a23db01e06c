"""The speculation benchmark's workloads (``spec_speed.py``): copy-heavy prompts made of the
project's own prose, and open chat questions, the same requests for every arm and round."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import numpy as np

from pdserve.bench.datasets import BenchRequest

INSTRUCTIONS = (  # (kind, weight, template): the copy workload's asks
    ("repeat", 2, "Repeat the following passage exactly, word for word:\n\n{}"),
    ("typos", 1, "Fix the typos in this passage and return it, otherwise unchanged:\n\n{}"),
    ("lines", 1, "Return this passage with each sentence on its own line:\n\n{}"),
    ("continue", 1, "Continue this text:\n\n{}"),
)
QUESTIONS = """\
Why is the sky blue?
How do vaccines train the immune system?
What makes a good teacher?
Explain how a bicycle stays upright.
What are the pros and cons of working from home?
How does a refrigerator keep food cold?
Describe the water cycle.
What should I pack for a week of hiking?
Why do leaves change colour in autumn?
How can I get better at public speaking?
What is the difference between weather and climate?
Write a short story about a lighthouse keeper.
How do airplanes fly?
What are some tips for learning a new language?
Explain photosynthesis to a ten-year-old.
Why is sleep important?
How does a credit score work?
What are black holes?
Suggest a plan for a rainy Sunday afternoon.
How do bees make honey?
What causes earthquakes?
Write a poem about the sea.
How should I prepare for a job interview?
What is the history of the printing press?
Why do cats purr?
How does recycling help the environment?
Explain what inflation is.
What are the benefits of regular exercise?
How do I make a simple tomato sauce?
Describe a day in the life of a medieval farmer.
What is machine learning?
How do tides work?
Give me advice on saving money.
Why did the Roman Empire fall?
How does the heart pump blood?
What makes a city pleasant to live in?
Explain how a compass works.
What are good habits for staying focused?
How are rainbows formed?
Describe how to plant a vegetable garden.
""".splitlines()  # the chat workload: open questions, long answers

# ---- the workloads ---------------------------------------------------------------------------


def prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of prose in markdown or a docstring: no code, tables, headings or drawings."""
    out: list[str] = []
    block: list[str] = []
    fenced = False
    for line in [*text.splitlines(), ""]:
        s = line.strip()
        if s.startswith("```"):
            fenced = not fenced
        code = fenced or s.startswith(("```", "#", "|", "<")) or line.startswith(("    ", "\t"))
        if code or not s:
            para = " ".join(block)
            letters = sum(ch.isalpha() or ch.isspace() for ch in para)
            if len(para.split()) >= 12 and letters >= 0.8 * len(para):
                out.append(para)
            block = []
        else:
            block.append(s)
    return out


def passages(paragraphs: list[str], lo: int = 150, hi: int = 300) -> list[str]:
    """Runs of whole sentences of consecutive paragraphs, ``lo``-``hi`` words each, ending
    where a paragraph does when they can."""
    out: list[str] = []
    cur: list[list[str]] = []  # the passage's paragraphs, each a list of sentences
    words = 0
    for para in paragraphs:
        cur.append([])
        for sentence in re.split(r"(?<=[.!?])\s+", para):
            n = len(sentence.split())
            if words + n > hi:
                if words >= lo:
                    out.append("\n\n".join(" ".join(p) for p in cur if p))
                cur, words = [[]], 0
                if n > hi:
                    continue
            cur[-1].append(sentence)
            words += n
        if words >= lo:
            out.append("\n\n".join(" ".join(p) for p in cur if p))
            cur, words = [], 0
    return out


def project_passages(root: Path) -> list[tuple[str, str]]:
    """(source, passage) from the project's text: its READMEs, DESIGN.md, module docstrings."""
    docs = [root / "README.md", root.parent / "shared/DESIGN.md", root / "bench/README.md"]
    texts = [(os.path.relpath(p, root), p.read_text()) for p in docs if p.is_file()]
    for path in sorted(root.glob("*/**/*.py")):
        if path.parts[len(root.parts)].startswith((".", "tests")):
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text()))
        except (SyntaxError, UnicodeDecodeError):  # a file mid-edit
            continue
        if doc:
            texts.append((path.relative_to(root).as_posix(), doc))
    docstrings = "\n\n".join(text for src, text in texts if src.endswith(".py"))
    found = [
        (src, p)
        for src, text in texts
        if not src.endswith(".py")
        for p in passages(prose_paragraphs(text))
    ]
    found += [("docstrings", p) for p in passages(prose_paragraphs(docstrings))]
    return found


def add_typos(text: str, rng: np.random.Generator, share: float = 0.1) -> str:
    """Swaps two inner letters of about ``share`` of the words of four letters or more."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) >= 4 and word.isalpha() and rng.random() < share:
            j = int(rng.integers(1, len(word) - 2))
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2 :]
    return " ".join(words)


def chat(text: str, max_tokens: int, kind: str) -> BenchRequest:
    message = {"role": "user", "content": text}
    return BenchRequest(text, max_tokens, len(text.split()), messages=(message,), kind=kind)


def copy_requests(
    found: list[tuple[str, str]], n: int, max_tokens: int, seed: int
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(found))
    weights = np.array([w for _, w, _ in INSTRUCTIONS], dtype=np.float64)
    out = []
    for i in range(n):
        _, text = found[order[i % len(found)]]
        kind, _, template = INSTRUCTIONS[
            int(rng.choice(len(INSTRUCTIONS), p=weights / weights.sum()))
        ]
        body = add_typos(text, rng) if kind == "typos" else text
        out.append(chat(template.format(body), max_tokens, f"copy-{kind}"))
    return out


def chat_requests(n: int, max_tokens: int, seed: int) -> list[BenchRequest]:
    order = np.random.default_rng(seed).permutation(len(QUESTIONS))
    return [chat(QUESTIONS[order[i % len(QUESTIONS)]], max_tokens, "chat") for i in range(n)]


def workload(
    name: str, found: list[tuple[str, str]], n: int, max_tokens: int, seed: int
) -> list[BenchRequest]:
    if name == "copy":
        return copy_requests(found, n, max_tokens, seed)
    return chat_requests(n, max_tokens, seed)


def requests_per_stream(streams: int) -> int:
    return 4 if streams == 1 else 3 if streams < 32 else 2
