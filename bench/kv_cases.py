"""Needle-in-a-haystack cases for bench_kv.py: needles, haystacks (synthetic or essays) and the case list.

A case is built deterministically from its id, so a rerun measures the same prompts. Haystacks are made of varied
sentences (a 135M model stops retrieving from a haystack of one repeated sentence after ~500 tokens), either
synthetic, from templates with many slot values, or natural, from the Paul Graham essays in
../shared/corpus/longctx (read at run time, never copied). Needles go between sentences at a depth, the fraction
of haystack sentences before them; a case is right when the needle's value appears in the answer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from bench.common import CORPUS

ESSAYS = CORPUS / "longctx" / "niah_paul_graham_essays"

# ---- needles -----------------------------------------------------------------------------------------------------
INGREDIENTS = ["cardamom", "saffron", "nutmeg", "tamarind", "sumac", "fenugreek", "juniper", "star anise"]
CODE_WORDS = ["bluebird", "marigold", "thunderbolt", "silverfox", "nightjar", "copperleaf", "driftwood", "moonstone"]
CITIES = ["Lisbon", "Helsinki", "Montreal", "Nairobi", "Osaka", "Valparaiso", "Reykjavik", "Tbilisi"]


@dataclass(frozen=True)
class Needle:
    """A fact hidden in the haystack, the question that asks for it, and the value the answer must contain."""

    kind: str  # passkey | ingredient | codeword | city
    text: str
    question: str
    value: str

    def found_in(self, answer: str) -> bool:
        return self.value.lower() in answer.lower()


def make_needle(kind: str, rng: random.Random) -> Needle:
    """A needle of ``kind`` with a value drawn from ``rng``."""
    if kind == "passkey":
        v = str(rng.randrange(10000, 100000))
        return Needle(kind, f"The pass key is {v}. Remember it. {v} is the pass key.",
                      "What is the pass key? Answer with the number.", v)
    if kind == "ingredient":
        v = rng.choice(INGREDIENTS)
        return Needle(kind, f"The secret ingredient of the recipe is {v}.",
                      "What is the secret ingredient of the recipe?", v)
    if kind == "codeword":
        v = rng.choice(CODE_WORDS)
        return Needle(kind, f"The code word for the mission is {v}.", "What is the code word for the mission?", v)
    if kind == "city":
        v = rng.choice(CITIES)
        return Needle(kind, f"The annual conference will take place in {v}.",
                      "In which city will the annual conference take place?", v)
    raise ValueError(f"unknown needle kind '{kind}'")


NEEDLE_KINDS = ("passkey", "ingredient", "codeword", "city")

# ---- haystacks ---------------------------------------------------------------------------------------------------
_NAMES = ("Alma Boris Clara Dmitri Elena Farid Greta Hugo Ines Jonas Kira Luca Mara Nils Olga Pavel Rosa Sven Tara "
          "Umar Vera Wim Yara Zeno Agnes Bruno Celia Dario Edith Felix").split()
_PLACES = ("market bakery library harbour garden workshop station museum orchard meadow bridge quarry chapel mill "
           "school clinic warehouse theatre stable pier").split()
_ITEMS = ("apples candles ropes lanterns blankets baskets boots kettles maps buttons pencils carpets jars bells nails "
          "shovels ladders barrels letters chairs").split()
_VERBS = "repaired painted carried counted cleaned sold sorted wrapped polished stacked measured inspected".split()
_ADJ = "old quiet busy narrow bright dusty windy small crowded sunny muddy tidy cold noisy".split()
_DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
_TEMPLATES = (
    "{n} walked to the {a} {p} and {v} the {i}.",
    "Near the {p}, {n} noticed that the {i} were {a2} again.",
    "Every morning {n} {v} some {i} before visiting the {p}.",
    "The {a} {p} was where {n} kept the {i} during the winter.",
    "{n} told {m} that the {i} at the {p} needed to be {v}.",
    "After lunch, {n} and {m} {v} the {i} behind the {a} {p}.",
    "Nobody at the {p} remembered who had {v} the {i}.",
    "The weather near the {p} was {a2}, so {n} stayed inside with the {i}.",
    "On {d}, the {p} was {a2} and {m} forgot the {i} there.",
    "{m} asked whether the {i} from the {p} had been {v} yet.",
    "It was {a} at the {p} when {n} finally {v} the last of the {i}.",
    "The {i} that {n} {v} last {d} are still at the {p}.",
    "According to {m}, the {a} {p} sells the best {i} in the valley.",
    "{n} wrote a short note about the {i} and left it at the {p}.",
)


def synthetic_sentences(rng: random.Random) -> Iterator[str]:
    """Endless varied filler sentences (templates x slot values, no two neighbours alike)."""
    previous = ""
    while True:
        s = rng.choice(_TEMPLATES).format(
            n=rng.choice(_NAMES), m=rng.choice(_NAMES), a=rng.choice(_ADJ), a2=rng.choice(_ADJ),
            p=rng.choice(_PLACES), i=rng.choice(_ITEMS), v=rng.choice(_VERBS), d=rng.choice(_DAYS))
        if s != previous:
            yield s
            previous = s


@lru_cache(maxsize=1)
def essay_sentences() -> tuple[str, ...]:
    """All sentences of the essays in file-name order; empty when the corpus is absent."""
    if not ESSAYS.is_dir():
        return ()
    text = " ".join(re.sub(r"\s+", " ", p.read_text(errors="replace")) for p in sorted(ESSAYS.glob("*.txt")))
    # The files join paragraphs without a space ("accelerating.We"): split after ., ! or ? before a capital too.
    parts = re.split(r"(?<=[.!?])\s*(?=[A-Z\"(\[])", text)
    return tuple(p.strip() for p in parts if len(p.strip()) > 1)


def essay_stream(rng: random.Random) -> Iterator[str]:
    """Essay sentences from a random starting point, wrapping around."""
    sents = essay_sentences()
    if not sents:
        raise FileNotFoundError(f"the essays are not at {ESSAYS}")
    start = rng.randrange(len(sents))
    for i in range(len(sents)):
        yield sents[(start + i) % len(sents)]


def essays_available() -> bool:
    return bool(essay_sentences())


# ---- cases -------------------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One prompt: a haystack of about ``target`` prompt tokens with needles at depths, and the questions to ask."""

    id: str
    target: int  # nominal size: 1024, 2048, 4096 or 8192 prompt tokens
    haystack: str  # synthetic | essays
    needles: list[tuple[Needle, float]]  # (needle, depth in [0, 1]); questions are asked in this order
    seed: int
    document: str = ""
    prefix_ids: tuple[int, ...] = field(default=(), repr=False)

    @property
    def multi(self) -> bool:
        return len(self.needles) > 1


def prefix_budget(target: int, limit: int, reserve: int) -> int:
    """Prefix tokens for a case of nominal size ``target``: the target minus the question, capped so that the
    question and the answer still fit the model's ``limit``."""
    return min(target - 32, limit - reserve)


def build_document(case: Case, prompt, tokenizer, max_prefix: int) -> None:
    """Fill ``case.document`` and ``case.prefix_ids``: haystack sentences up to ``max_prefix`` prefix tokens with
    the needles inserted at their depths (rebuilt until the real tokenisation fits)."""
    rng = random.Random(case.seed)
    values = [n.value.lower() for n, _ in case.needles]
    stream = synthetic_sentences(rng) if case.haystack == "synthetic" else essay_stream(rng)
    head = len(prompt.prefix(""))
    room = max_prefix - head - sum(len(tokenizer(" " + n.text, add_special_tokens=False).input_ids)
                                   for n, _ in case.needles)
    sents: list[str] = []
    total = 0
    for s in stream:
        if any(v in s.lower() for v in values):  # the haystack must not already contain an answer
            continue
        n = len(tokenizer(" " + s, add_special_tokens=False).input_ids)
        if total + n > room:
            break
        sents.append(s)
        total += n
    while True:
        parts = list(sents)
        for needle, depth in sorted(case.needles, key=lambda nd: -nd[1]):  # deepest first keeps indices valid
            parts.insert(round(depth * len(sents)), needle.text)
        document = " ".join(parts)
        ids = prompt.prefix(document).ids
        if len(ids) <= max_prefix:
            case.document, case.prefix_ids = document, tuple(ids)
            return
        sents.pop()


def _depths(n: int) -> list[float]:
    return [round(i / (n - 1), 3) for i in range(n)] if n > 1 else [0.5]


def _tag(seed_offset: int) -> str:
    return f"+{seed_offset}" if seed_offset else ""


def single_cases(plan: dict[int, int], with_essays: bool, seed_offset: int = 0) -> list[Case]:
    """``plan``: {target tokens: number of cases}; depths evenly from 0 to 1, needle kinds and haystacks rotate.

    ``seed_offset`` draws other needles and haystacks at the same sizes, depths and kinds (ids get ``+offset``): a
    held-out set for settings chosen on the usual one.
    """
    out = []
    for size_index, (target, count) in enumerate(sorted(plan.items())):
        for i, depth in enumerate(_depths(count)):
            seed = target * 1000 + i + seed_offset
            rng = random.Random(seed)
            kind = NEEDLE_KINDS[(i + size_index) % len(NEEDLE_KINDS)]  # each size starts on another kind
            haystack = "essays" if with_essays and (i // 2) % 2 == 1 else "synthetic"
            out.append(Case(f"s{target // 1024}k-{i:02d}{_tag(seed_offset)}", target, haystack,
                            [(make_needle(kind, rng), depth)], seed))
    return out


#: Multi-question pairs: a pass key and a word-valued needle, asked with clearly different wording.
_PAIRS = (("passkey", "city"), ("codeword", "passkey"), ("passkey", "ingredient"), ("city", "passkey"),
          ("passkey", "codeword"))
_PAIR_DEPTHS = ((0.2, 0.7), (0.75, 0.25), (0.1, 0.55), (0.5, 0.9), (0.35, 0.05), (0.85, 0.45))


def multi_cases(plan: dict[int, int], with_essays: bool, seed_offset: int = 0) -> list[Case]:
    """Two needles at different depths; question A then question B on one prefill (``seed_offset``: as above)."""
    out = []
    for target, count in plan.items():
        for i in range(count):
            seed = target * 1000 + 500 + i + seed_offset
            rng = random.Random(seed)
            kinds = _PAIRS[i % len(_PAIRS)]
            depths = _PAIR_DEPTHS[i % len(_PAIR_DEPTHS)]
            haystack = "essays" if with_essays and i % 2 == 1 else "synthetic"
            needles = [(make_needle(k, rng), d) for k, d in zip(kinds, depths)]
            out.append(Case(f"m{target // 1024}k-{i:02d}{_tag(seed_offset)}", target, haystack, needles, seed))
    return out


def questions(case: Case) -> Sequence[str]:
    return [n.question for n, _ in case.needles]
