"""Cases for bench_fidelity.py: documents of 2K-8K tokens with planted facts, and real questions on real documents.

Two halves that share no needle template, no haystack and no seed: settings are chosen on ``tune`` and confirmed on
``check``. Each half mixes several generators:

- planted facts (1-3 per document, at any depth) of many kinds (codes, times, dates, names, amounts with units,
  places, two-part facts, numbers), in haystacks of natural text: the Paul Graham essays (even files for tune, odd
  for check), LEval documents (multidoc_qa for tune, scientific_qa for check) and text extracted from the corpus PDFs
  (a 10-K for tune; a policy report and a product guide for check);
- real questions: LEval's own questions on LEval documents that fit the model (no planted fact; they count only for
  agreement with the full cache).

Every document gets 2-4 questions, shuffled, all answered from one prefill. The corpus is read at run time and
never copied into the project; without it this module raises a FileNotFoundError naming the folder.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache

from bench.common import CORPUS

ESSAYS = CORPUS / "longctx" / "niah_paul_graham_essays"
LEVAL = CORPUS / "longctx" / "leval"
DOCQA = CORPUS / "docqa" / "mmlongbench_doc" / "documents"


@dataclass(frozen=True)
class Fact:
    """A planted sentence, the question that asks for it, and the parts a right answer must all contain."""

    kind: str
    text: str
    question: str
    parts: tuple[str, ...]

    def found_in(self, answer: str) -> bool:
        flat = _norm(answer)
        return all(_norm(p) in flat for p in self.parts)


def _norm(text: str) -> str:
    return re.sub(r"[\s,]+", " ", text.lower()).strip()


# ---- fact templates: each half has its own wording and value pools -----------------------------------------------
_FIRST = {"tune": "Ingrid Tomas Leona Marek Priya Oskar Selma Idris Fenna Caius".split(),
          "check": "Rosalind Anselm Mireille Torvald Ines Bastian Ottilie Cosmin Halina Evander".split()}
_LAST = {"tune": "Halvorsen Quintero Abernethy Vukovic Lindqvist Okafor Brannigan Castellano".split(),
         "check": "Pemberton Ostrowski Achterberg Delacroix Nakamura Fairweather Szabo Ribeiro".split()}
_TOWNS = {"tune": "Dunmore Kelvedon Ashcombe Brightwater Harlow Fennick Oakridge Millbrook".split(),
          "check": "Saltmarsh Wrenfield Caldermoor Thistlebury Elmstead Norcastle Greywick Amberly".split()}
_COMPANIES = {"tune": ["Norvik Pumps", "Ardent Systems", "Belcourt Energy", "Tamsin Logistics"],
              "check": ["Harrowgate Electrical", "Velmont Services", "Quarry Lane Engineering", "Ostler & Sons"]}
_MONTHS = "January February March April May June July August September October November December".split()


def _code(rng: random.Random) -> str:
    letters = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(3))
    return f"{letters}-{rng.randrange(1000, 10000)}"


def _time(rng: random.Random) -> str:
    return f"{rng.randrange(1, 13)}:{rng.choice(['05', '10', '15', '20', '25', '35', '40', '45', '50', '55'])} " \
           f"{rng.choice(['AM', 'PM'])}"


def _date(rng: random.Random) -> str:
    return f"{rng.randrange(2, 28)} {rng.choice(_MONTHS)} {rng.randrange(2027, 2041)}"


def _name(rng: random.Random, half: str) -> str:
    return f"{rng.choice(_FIRST[half])} {rng.choice(_LAST[half])}"


def _amount(rng: random.Random, unit: str) -> str:
    return f"{rng.randrange(11, 99)},{rng.randrange(100, 1000)} {unit}"


FactMaker = Callable[[random.Random], Fact]

#: kind -> maker, one table per half; the two tables share kinds but not wording or values.
TEMPLATES: dict[str, dict[str, FactMaker]] = {
    "tune": {
        "code": lambda r: (v := _code(r)) and Fact("code", f"The access code for the server room is {v}.",
                                                   "What is the access code for the server room?", (v,)),
        "time": lambda r: (v := _time(r)) and Fact("time", f"The last ferry to the island leaves at {v}.",
                                                   "When does the last ferry to the island leave?", (v,)),
        "date": lambda r: (v := _date(r)) and Fact("date", f"The lease on the warehouse ends on {v}.",
                                                   "When does the lease on the warehouse end?", (v,)),
        "name": lambda r: (v := _name(r, "tune")) and Fact(
            "name", f"The new head of the research lab is {v}.", "Who is the new head of the research lab?", (v,)),
        "amount": lambda r: (v := _amount(r, "litres")) and Fact(
            "amount", f"The water tank on the roof holds {v}.", "How much does the water tank on the roof hold?",
            (v,)),
        "place": lambda r: (v := r.choice(_TOWNS["tune"])) and Fact(
            "place", f"The family archive is kept in the town of {v}.", "In which town is the family archive kept?",
            (v,)),
        "two_part": lambda r: (room := f"{r.randrange(2, 9)}{r.choice('ABCDE')}", floor := r.choice(
            ["second", "third", "fourth", "fifth", "sixth"])) and Fact(
            "two_part", f"The quarterly board meeting is held in room {room} on the {floor} floor.",
            "Where is the quarterly board meeting held? Give the room and the floor.", (room, floor)),
        "number": lambda r: (v := str(r.randrange(10000, 100000))) and Fact(
            "number", f"The pass key is {v}. Remember it.", "What is the pass key?", (v,)),
    },
    "check": {
        "code": lambda r: (v := _code(r)) and Fact("code", f"Use the voucher code {v} to claim the refund.",
                                                   "Which voucher code claims the refund?", (v,)),
        "time": lambda r: (v := _time(r)) and Fact("time", f"Check-in for the pottery workshop closes at {v}.",
                                                   "At what time does check-in for the pottery workshop close?",
                                                   (v,)),
        "date": lambda r: (v := _date(r)) and Fact("date", f"The warranty on the boiler expires on {v}.",
                                                   "On what date does the warranty on the boiler expire?", (v,)),
        "name": lambda r: (v := _name(r, "check")) and Fact(
            "name", f"The purchase contract was signed on behalf of the buyer by {v}.",
            "Who signed the purchase contract on behalf of the buyer?", (v,)),
        "amount": lambda r: (v := _amount(r, "euros")) and Fact(
            "amount", f"The penalty for late delivery is {v} per day.", "What is the daily penalty for late delivery?",
            (v,)),
        "place": lambda r: (v := r.choice(_TOWNS["check"])) and Fact(
            "place", f"The spare set of keys is held by the notary in {v}.",
            "Where is the spare set of keys held?", (v,)),
        "two_part": lambda r: (weeks := str(r.randrange(3, 13)), co := r.choice(_COMPANIES["check"])) and Fact(
            "two_part", f"The backup generator is serviced every {weeks} weeks by {co}.",
            "How often is the backup generator serviced, and by which company?", (weeks, co)),
        "number": lambda r: (v := str(r.randrange(100000, 1000000))) and Fact(
            "number", f"The combination of the vault is {v}.", "What is the combination of the vault?", (v,)),
    },
}


# ---- haystacks ---------------------------------------------------------------------------------------------------
def _sentences(text: str) -> list[str]:
    text = re.sub(r"\s+", " ", text)
    parts = re.split(r"(?<=[.!?])\s*(?=[A-Z\"(\[])", text)
    return [p.strip() for p in parts if len(p.strip()) > 1]


def _need(path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: bench_fidelity needs ../shared/corpus (or DOCFUSE_CORPUS)")


@lru_cache(maxsize=None)
def essays(half: str) -> tuple[str, ...]:
    _need(ESSAYS)
    files = sorted(ESSAYS.glob("*.txt"))[0 if half == "tune" else 1::2]
    return tuple(s for f in files for s in _sentences(f.read_text(errors="replace")))


@lru_cache(maxsize=None)
def leval(half: str) -> tuple[dict, ...]:
    path = LEVAL / ("multidoc_qa.jsonl" if half == "tune" else "scientific_qa.jsonl")
    _need(path)
    seen, rows = set(), []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        key = row["input"][:200]
        if key not in seen:  # the files repeat a few documents
            seen.add(key)
            rows.append(row)
    return tuple(rows)


@lru_cache(maxsize=None)
def pdf_text(half: str) -> tuple[str, ...]:
    import pymupdf

    names = ["NETFLIX_2015_10K.pdf"] if half == "tune" else ["Independents-Report.pdf", "watch_d.pdf"]
    out: list[str] = []
    for name in names:
        _need(DOCQA / name)
        with pymupdf.open(DOCQA / name) as doc:
            out += _sentences(" ".join(page.get_text() for page in doc))
    return tuple(s for s in out if len(s.split()) >= 4)


def haystack_stream(source: str, half: str, rng: random.Random) -> Iterator[str]:
    """Sentences of one haystack from a random start, wrapping around."""
    if source == "essays":
        sents = essays(half)
    elif source == "leval":
        sents = tuple(_sentences(rng.choice(leval(half))["input"]))
    else:
        sents = pdf_text(half)
    start = rng.randrange(len(sents))
    for i in range(10 * len(sents)):
        yield sents[(start + i) % len(sents)]


# ---- cases -------------------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One document and the questions asked of its one prefill (in this order)."""

    id: str
    half: str
    generator: str  # planted:<haystack> | real:leval
    document: str
    questions: list[str]
    facts: list[Fact | None] = field(default_factory=list)  # per question; None for a real question
    references: list[str] = field(default_factory=list)  # per question: the dataset's answer ("" for planted)
    tokens: int = 0

    def to_json(self) -> dict:
        return {"id": self.id, "half": self.half, "generator": self.generator, "tokens": self.tokens,
                "questions": self.questions, "references": self.references,
                "facts": [None if f is None else {"kind": f.kind, "text": f.text, "parts": list(f.parts)}
                          for f in self.facts]}


#: Seeds: tune and check draw from disjoint ranges.
SEED_BASE = {"tune": 10_000, "check": 90_000}
HAYSTACKS = ("essays", "leval", "pdf")
#: Extra questions for a document with fewer facts than questions: asked of every kind of document.
FILLERS = {"tune": ["What is this document mainly about?", "Name one organisation mentioned in the document."],
           "check": ["Summarise the document in one sentence.", "Which person is mentioned first in the document?"]}


def planted_case(half: str, index: int, tokenizer, min_tokens: int, max_tokens: int) -> Case:
    """A haystack of ``min_tokens``-``max_tokens`` tokens with 1-3 facts at random depths, 2-4 questions."""
    seed = SEED_BASE[half] + index
    rng = random.Random(seed)
    source = HAYSTACKS[index % len(HAYSTACKS)]
    n_facts = rng.choice([1, 2, 2, 3, 3])
    kinds = rng.sample(sorted(TEMPLATES[half]), n_facts)
    facts = [TEMPLATES[half][k](rng) for k in kinds]
    target = rng.randrange(min_tokens, max_tokens)
    values = [_norm(p) for f in facts for p in f.parts]
    sents, total = [], sum(len(tokenizer(" " + f.text).input_ids) for f in facts)
    for s in haystack_stream(source, half, rng):
        if any(v in _norm(s) for v in values):  # the haystack must not already hold an answer
            continue
        n = len(tokenizer(" " + s).input_ids)
        if total + n > target:
            break
        sents.append(s)
        total += n
    for f in sorted(facts, key=lambda _: rng.random()):
        sents.insert(rng.randrange(len(sents) + 1), f.text)
    # Paragraphs of 4-8 sentences, so the PDF has a natural layout.
    paragraphs, i = [], 0
    while i < len(sents):
        k = rng.randrange(4, 9)
        paragraphs.append(" ".join(sents[i:i + k]))
        i += k
    questions = [f.question for f in facts]
    qfacts: list[Fact | None] = list(facts)
    n_questions = max(2, min(4, n_facts + rng.choice([0, 1])))
    for filler in rng.sample(FILLERS[half], n_questions - n_facts):
        questions.append(filler)
        qfacts.append(None)
    order = list(range(len(questions)))
    rng.shuffle(order)
    return Case(f"{half}-p{index:03d}-{source}", half, f"planted:{source}", "\n\n".join(paragraphs),
                [questions[i] for i in order], [qfacts[i] for i in order], [""] * len(order), total)


def real_cases(half: str, tokenizer, max_tokens: int, count: int) -> list[Case]:
    """LEval documents that fit, each with 2-4 of its own questions (shuffled)."""
    out = []
    for n, row in enumerate(leval(half)):
        if len(out) >= count:
            break
        tokens = len(tokenizer(row["input"]).input_ids)
        if tokens > max_tokens:
            continue
        rng = random.Random(SEED_BASE[half] + 5000 + n)
        pairs = [(q.strip(), str(a).strip()) for q, a in zip(row["instructions"], row["outputs"]) if q.strip()]
        pairs = rng.sample(pairs, min(len(pairs), rng.randrange(2, 5)))
        out.append(Case(f"{half}-r{n:03d}-leval", half, "real:leval", row["input"].strip(),
                        [q for q, _ in pairs], [None] * len(pairs), [a for _, a in pairs], tokens))
    return out


def build(half: str, tokenizer, planted: int, real: int, min_tokens: int = 2000, max_tokens: int = 7400
          ) -> list[Case]:
    """The ``half``'s cases: ``planted`` documents with facts and ``real`` LEval documents with their questions."""
    if half not in SEED_BASE:
        raise ValueError(f"half must be 'tune' or 'check', got {half!r}")
    cases = [planted_case(half, i, tokenizer, min_tokens, max_tokens) for i in range(planted)]
    return cases + real_cases(half, tokenizer, max_tokens, real)
