"""Synthetic verifiable tasks with a character tokenizer, for GRPO that runs on two CPU cores.

A task is anything with the :class:`Task` interface: it samples prompts with their reference answers,
scores a completion with a reward in [0, 1], has a fixed held-out evaluation set, and makes the
tokenizer its prompts are written for. Plug in your own by implementing the four methods (prompts are
plain strings; the tokenizer is anything with the :class:`Tokenizer` interface, such as
:class:`CharTokenizer`) and registering the class in :data:`TASKS` under its ``name``: a run config's
``task = "<name>"`` (with ``task_kwargs``) then builds it.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


class Tokenizer(Protocol):
    """What the loop needs of a tokenizer: text <-> ids, and the special ids the model config names."""

    PAD: int
    BOS: int
    EOS: int

    @property
    def vocab_size(self) -> int:
        """Ids are ``0 .. vocab_size - 1``; the model's vocabulary must be at least this large."""

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        """Ids of ``text``, led by ``BOS`` when ``bos``."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` up to the first ``EOS`` (a completion, as :meth:`Task.reward` reads it)."""


class Task(Protocol):
    name: str

    def make_tokenizer(self) -> Tokenizer:
        """The tokenizer this task's prompts and answers are written for."""

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        """``n`` training examples drawn with ``rng`` (deterministic given its state)."""

    def reward(self, example: Example, completion: str) -> float:
        """Reward of a decoded completion (stop token excluded), in [0, 1]."""

    def eval_set(self, n: int = 128) -> list[Example]:
        """A fixed held-out set, disjoint from what :meth:`sample` draws."""


class CharTokenizer:
    """One token per character, plus pad/bos/eos. Ids are stable: specials first, then the alphabet."""

    PAD, BOS, EOS = 0, 1, 2
    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self, alphabet: str = "0123456789+=RS"):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
        self.alphabet = alphabet
        self._id = {c: i + len(self.SPECIALS) for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.SPECIALS) + len(self.alphabet)

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        try:
            ids = [self._id[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} of {text!r} is not in the alphabet {self.alphabet!r}") from None
        return [self.BOS, *ids] if bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, stopping at the first EOS; other specials are dropped, and ids beyond the
        vocabulary (a model's embedding table may be larger) decode as ``"?"``, which no answer contains."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.EOS:
                break
            if i >= self.vocab_size:
                out.append("?")
            elif i >= len(self.SPECIALS):
                out.append(self.alphabet[i - len(self.SPECIALS)])
        return "".join(out)


def hf_tokenizer(tok: CharTokenizer):
    """``tok`` as a transformers ``PreTrainedTokenizerFast``, built offline (no download): the same ids
    (one token per character, ``<bos>`` first), left padding with ``<pad>``, ``<eos>`` as EOS, and
    decoding that joins characters without spaces. What a TRL trainer's ``processing_class`` needs."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(tok.SPECIALS)}
    vocab.update({c: i + len(tok.SPECIALS) for i, c in enumerate(tok.alphabet)})
    raw = RawTokenizer(models.WordLevel(vocab, unk_token=tok.SPECIALS[tok.PAD]))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.decoder = decoders.Fuse()
    bos = tok.SPECIALS[tok.BOS]
    raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.BOS)])
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token=tok.SPECIALS[tok.PAD], bos_token=bos,
                                   eos_token=tok.SPECIALS[tok.EOS], padding_side="left")


def _exact(example: Example, completion: str) -> float:
    return 1.0 if completion.strip() == example.answer else 0.0


def _per_position(example: Example, completion: str) -> float:
    """Share of positions where the completion has the answer's character, over the longer of the two
    (a short answer loses the rest, a long one pays for the extra characters); 1 exactly when equal."""
    c, a = completion.strip(), example.answer
    if c == a:
        return 1.0
    return sum(x == y for x, y in zip(c, a)) / max(len(a), len(c))


@dataclasses.dataclass
class Addition:
    """``"a+b="`` -> ``str(a+b)`` for non-negative integers of up to ``digits`` digits."""

    digits: int = 2
    name: str = "addition"

    def _pair(self, rng: random.Random) -> tuple[int, int]:
        hi = 10**self.digits - 1
        return rng.randint(0, hi), rng.randint(0, hi)

    def _example(self, a: int, b: int) -> Example:
        return Example(f"{a}+{b}=", str(a + b))

    def _held_out(self, a: int, b: int) -> bool:
        return (a * 31 + b * 17) % 10 == 0  # a fixed tenth of all pairs never appears in training

    def make_tokenizer(self) -> CharTokenizer:
        return CharTokenizer()

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        return [self._example(*p) for p in _draws(rng, self._pair, lambda a, b: not self._held_out(a, b), n)]

    def reward(self, example: Example, completion: str) -> float:
        return _exact(example, completion)

    def eval_set(self, n: int = 128) -> list[Example]:
        return [self._example(*p) for p in _draws(random.Random(12345), self._pair, self._held_out, n)]


@dataclasses.dataclass
class Reverse:
    """``"R<digits>="`` -> the digit string reversed; length ``min_len..max_len``. Partial credit per
    correct position keeps the reward informative early on."""

    min_len: int = 3
    max_len: int = 6
    name: str = "reverse"

    def _digits(self, rng: random.Random) -> str:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(self.min_len, self.max_len)))

    def _held_out(self, s: str) -> bool:
        return sum(map(int, s)) % 10 == 7

    def make_tokenizer(self) -> CharTokenizer:
        return CharTokenizer()

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            s = self._digits(rng)
            if not self._held_out(s):
                out.append(Example(f"R{s}=", s[::-1]))
        return out

    def reward(self, example: Example, completion: str) -> float:
        c, a = completion.strip(), example.answer
        if c == a:
            return 1.0
        hits = sum(x == y for x, y in zip(c, a))
        return 0.5 * hits / max(len(a), len(c))

    def eval_set(self, n: int = 128) -> list[Example]:
        rng = random.Random(54321)
        out = []
        while len(out) < n:
            s = self._digits(rng)
            if self._held_out(s):
                out.append(Example(f"R{s}=", s[::-1]))
        return out


@dataclasses.dataclass
class CountBy:
    """``"A<start>+<step>="`` -> the next ``terms`` terms of ``start + k * step`` (k = 1..terms) modulo
    ``m = 10**digits``, start in ``[0, m)`` and step in ``[1, m)``, every number written with ``digits``
    digits and no separator: 32 answer tokens by default (16 two-digit terms). Each term is the
    previous one plus the step, so a slip propagates down the chain, as in long reasoning, while each
    step needs only local context (the previous term a fixed few tokens back, and the step after the
    only ``+``). Partial credit per correct position.

    The held-out pairs are a hash of the whole (start, step) modulo 11, so every combination of a
    units digit, a step and a carry also occurs in training (a rule on the units digit alone would
    hold out combinations the model never sees, and it would memorise the rest)."""

    terms: int = 16
    digits: int = 2
    max_step: int | None = None  # steps drawn from 1..max_step (None: up to 10**digits - 1)
    credit: str = "answer"  # "answer": positions equal to the answer's; "rule": terms that follow the rule
    name: str = "count"

    def __post_init__(self) -> None:
        for field in ("terms", "digits"):
            v = getattr(self, field)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{field} must be a positive integer, got {v!r}")
        if self.credit not in ("answer", "rule"):
            raise ValueError(f"credit must be 'answer' or 'rule', got {self.credit!r}")
        top = 10**self.digits - 1
        if self.max_step is not None and not (isinstance(self.max_step, int) and 1 <= self.max_step <= top):
            raise ValueError(f"max_step must be an integer in [1, {top}] (or None), got {self.max_step!r}")

    def _pair(self, rng: random.Random) -> tuple[int, int]:
        m = 10**self.digits
        return rng.randrange(m), rng.randrange(1, (self.max_step or m - 1) + 1)

    def _example(self, start: int, step: int) -> Example:
        m, d = 10**self.digits, self.digits
        terms = "".join(f"{(start + k * step) % m:0{d}d}" for k in range(1, self.terms + 1))
        return Example(f"A{start:0{d}d}+{step:0{d}d}=", terms)

    def _held_out(self, start: int, step: int) -> bool:
        return (start * 7 + step * 3) % 11 == 5  # a fixed eleventh of the (start, step) pairs

    def make_tokenizer(self) -> CharTokenizer:
        return CharTokenizer("0123456789+=RSPA")

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        return [self._example(*p) for p in _draws(rng, self._pair, lambda a, b: not self._held_out(a, b), n)]

    def reward(self, example: Example, completion: str) -> float:
        if self.credit == "answer":
            return _per_position(example, completion)
        return self._rule_credit(example, completion)

    def _rule_credit(self, example: Example, completion: str) -> float:
        """Share of the ``terms`` terms that equal the *completion's own* previous term plus the step
        (the first: the start plus the step), over ``terms`` or the completion's term count if larger: a slip
        costs its own term, not every term after it, which per-position credit against the answer
        would charge (the following terms are then all off the answer's chain). 1 exactly when the
        completion is the answer."""
        c, d = completion.strip(), self.digits
        if c == example.answer:
            return 1.0
        chunks = [c[i:i + d] for i in range(0, len(c), d)]
        return self._following(example, chunks) / max(self.terms, len(chunks))

    def _following(self, example: Example, chunks: list[str]) -> int:
        """How many of the first ``terms`` chunks equal the previous chunk (the first: the start) plus
        the step, up to the first malformed one (no later term has a previous one to follow)."""
        d, m = self.digits, 10**self.digits
        start, step = int(example.prompt[1:1 + d]), int(example.prompt[2 + d:2 + 2 * d])
        good, prev = 0, start
        for chunk in chunks[: self.terms]:
            if len(chunk) == d and chunk.isdigit():
                good += int(chunk) == (prev + step) % m
                prev = int(chunk)
            else:
                break
        return good

    def eval_set(self, n: int = 128) -> list[Example]:
        rng = random.Random(13579)
        return [self._example(*p) for p in _distinct(rng, self._pair, self._held_out, n)]


@dataclasses.dataclass
class LongCount(CountBy):
    """The long-output task: ``"A<start>+<step>="`` -> the next ``terms`` terms of
    ``start + k * step`` (k = 1..terms) modulo ``m = 10**digits``, each written with ``digits`` digits
    and followed by ``sep``: 130 terms of 3 digits and a comma, 520 answer tokens plus the end token with
    the character tokenizer (every answer has the same length, so the eval set's mean is 520).

    Why a long count rather than sorting with its steps written out or a search trace: it is the one
    of the three a tiny model is known to learn here. The count task with 3-digit terms and 1-digit
    steps reached a held-out per-position reward of 0.60 after 200 SFT steps on the 8-layer model
    (docs/results/count3-8l.md), and each term needs only local context (the previous term a fixed
    ``digits + 1`` tokens back, the step after the only ``+``), so its difficulty does not grow with
    the answer's length while the summed train-rollout mismatch does, which is what the long-output runs
    measures. A bubble-sort trace needs comparisons across a whole list the model must attend to,
    and whether the 8-layer model learns it in an affordable SFT is unknown; it would spend the
    issue's budget on a learnability question it does not ask. The chain carries a slip forward (one
    wrong carry puts every later term off the answer), as in long reasoning, so the answer's tail
    is where the model can still gain and where a mismatched rollout can lose.

    The separator keeps a term's boundary explicit: a dropped or extra digit costs its own term in
    the per-term credit below instead of shifting every later position.

    Reward (graded, in [0, 1]): ``credit = "answer"``: the share of terms equal to the answer's term
    at the same index (the completion split at ``sep``), over ``terms`` or the completion's term count
    if larger, so extra terms are paid for. Because a slip puts the rest off the chain, this is
    close to the correct prefix's length over the answer's: samples of a group slip at different
    terms, so their rewards differ and GRPO's group-normalised advantage is non-zero (an exact-match
    reward at 130 terms would be 0 for every sample of nearly every group, and no signal).
    ``credit = "rule"``: the share of terms that equal the completion's own previous term plus the
    step, so a slip costs one term (as in :class:`CountBy`). 1 exactly when the completion is the
    answer; text that is not terms of ``digits`` digits earns 0.

    The held-out (start, step) pairs are the same eleventh by hash as :class:`CountBy`'s (every
    units digit, step and carry also occurs in training)."""

    terms: int = 130
    digits: int = 3
    max_step: int | None = 9  # one-digit steps: the count3-8l setting the 8-layer model learnt
    credit: str = "answer"  # "answer": terms equal to the answer's; "rule": terms that follow the rule
    name: str = "long-count"
    sep: str = ","

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.sep) != 1 or self.sep.isdigit() or self.sep in "+=A":
            raise ValueError(f"sep must be one character other than a digit, '+', '=' or 'A', got {self.sep!r}")

    @property
    def answer_tokens(self) -> int:
        """Answer length in tokens (the end token excluded): what ``max_new_tokens`` must exceed."""
        return self.terms * (self.digits + 1)

    def _example(self, start: int, step: int) -> Example:
        m, d = 10**self.digits, self.digits
        terms = "".join(f"{(start + k * step) % m:0{d}d}{self.sep}" for k in range(1, self.terms + 1))
        return Example(f"A{start:0{d}d}+{step:0{d}d}=", terms)

    def make_tokenizer(self) -> CharTokenizer:
        return CharTokenizer("0123456789+=A" + self.sep)

    def _chunks(self, completion: str) -> list[str]:
        c = completion.strip()
        if c.endswith(self.sep):  # the answer's own trailing separator closes the last term
            c = c[:-1]
        return c.split(self.sep) if c else []

    def reward(self, example: Example, completion: str) -> float:
        if completion.strip() == example.answer:
            return 1.0
        chunks = self._chunks(completion)
        denom = max(self.terms, len(chunks))
        if self.credit == "answer":
            want = self._chunks(example.answer)
            return sum(c == w for c, w in zip(chunks, want)) / denom
        return self._following(example, chunks) / denom

    def eval_set(self, n: int = 128) -> list[Example]:
        rng = random.Random(24680)
        return [self._example(*p) for p in _distinct(rng, self._pair, self._held_out, n)]


def _draws(rng: random.Random, draw, keep, n: int) -> list:
    """The first ``n`` draws that ``keep`` accepts, in draw order (repeats included)."""
    out = []
    while len(out) < n:
        p = draw(rng)
        if keep(*p):
            out.append(p)
    return out


def _distinct(rng: random.Random, draw, keep, n: int) -> list:
    """Up to ``n`` distinct draws that ``keep`` accepts, in draw order (fewer when the space is smaller)."""
    seen: dict = {}
    for _ in range(200 * n):
        p = draw(rng)
        if keep(*p) and p not in seen:
            seen[p] = None
            if len(seen) == n:
                break
    return list(seen)


TASKS: dict[str, type] = {"addition": Addition, "reverse": Reverse, "count": CountBy, "long-count": LongCount}
"""Task classes by the name a run config gives (``task = "reverse"``); add your own here."""


def make_task(name: str, **kwargs) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {sorted(TASKS)}")
    return TASKS[name](**kwargs)
