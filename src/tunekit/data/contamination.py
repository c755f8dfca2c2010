"""Data contamination: duplicates inside the training data, and overlap between training and held-out data.
Torch-free; each example is a (prompt, answer) pair of strings (`texts` makes them from records).

    found = contamination.check(train_pairs, eval_pairs, n=13, dedup=False, decontaminate=False)
    found.line(); found.to_json(); found.dropped   # the log line, run.json's counts, indices to drop

What is measured and how: docs/data.md, "Contamination"."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from tunekit.config.schema import DataConfig
from tunekit.core.errors import TunekitError
from tunekit.data.formats import FORMATS, Parsed, Record
from tunekit.tooluse.records import call_json

DEFAULT_N = 13
MANY = 0.1  # a share of training dropped worth a warning
log = logging.getLogger("tunekit")
SHOWN = 5  # locations kept for to_json()

# Han (with extension A, compatibility and the supplementary planes), hiragana and katakana
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
_WORD = re.compile(rf"[{_CJK}]|[^\W{_CJK}]+")
_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """NFKC, casefold, whitespace runs collapsed to one space, stripped."""
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text or "").casefold()).strip()


def words(normalized: str) -> list[str]:
    """The words of a normalised text: \\w+ runs, each CJK character a word."""
    return _WORD.findall(normalized)


def digest(text: str) -> int:
    """A stable 64-bit digest of a string."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def ngrams(tokens: list[str], n: int) -> Iterator[int]:
    """Digests of the n-word spans of `tokens` (none when there are fewer than n)."""
    for i in range(len(tokens) - n + 1):
        yield digest(" ".join(tokens[i:i + n]))


@dataclass(frozen=True)
class Contamination:
    """What `check` found. Index lists are sorted; eval indices count within the eval set, training
    indices within the training data, both in the order the pairs were given."""

    n: int
    train_size: int
    eval_size: int
    duplicates: list[int]  # training indices dedup drops: each copy after the first
    eval_exact: list[int]  # eval examples whose prompt or answer occurs exactly in training
    eval_ngram: list[int]  # eval examples sharing an n-gram with training (exact ones too, if n words long)
    overlapping: list[int]  # training indices decontaminate drops
    dedup: bool = False
    decontaminate: bool = False
    duplicate_pairs: list[tuple[int, int]] = field(default_factory=list)  # first few (copy, original)
    overlap_pairs: list[tuple[int, int, str]] = field(default_factory=list)  # first few (eval, train, how)

    @property
    def eval_contaminated(self) -> list[int]:
        """Eval examples matched either way."""
        return sorted(set(self.eval_exact) | set(self.eval_ngram))

    @property
    def dropped(self) -> list[int]:
        """Training indices to drop under the dedup and decontaminate flags."""
        drop = set(self.duplicates) if self.dedup else set()
        return sorted(drop | set(self.overlapping)) if self.decontaminate else sorted(drop)

    def line(self) -> str:
        share = len(self.duplicates) / self.train_size if self.train_size else 0.0
        held = (f"{len(self.eval_exact)} of {self.eval_size} eval examples share a prompt or answer with "
                f"training, {len(self.eval_ngram)} share a {self.n}-gram "
                f"({len(self.overlapping)} training examples overlap them)") if self.eval_size else "no held-out data"
        dropped = f"; {len(self.dropped)} training examples dropped" if self.dropped else ""
        return (f"contamination: {len(self.duplicates)} duplicate training examples ({share:.1%}); {held}; "
                f"dedup {'on' if self.dedup else 'off'}, decontaminate {'on' if self.decontaminate else 'off'}"
                f"{dropped}")

    def to_json(self) -> dict:
        """Counts, the settings and up to 5 locations of each kind: a plain dict for run.json. An overlap's
        "match" is "prompt" or "answer" (exact) or "<n>-gram"."""
        return {
            "n": self.n, "train_examples": self.train_size, "eval_examples": self.eval_size,
            "duplicates": len(self.duplicates), "eval_exact": len(self.eval_exact),
            "eval_ngram": len(self.eval_ngram), "eval_contaminated": len(self.eval_contaminated),
            "overlapping_train": len(self.overlapping), "dedup": self.dedup,
            "decontaminate": self.decontaminate, "dropped": len(self.dropped),
            "duplicate_examples": [{"train": c, "copy_of": o} for c, o in self.duplicate_pairs[:SHOWN]],
            "overlap_examples": [{"eval": e, "train": t, "match": how} for e, t, how in self.overlap_pairs[:SHOWN]],
        }


class _EvalIndex:
    """The eval side: digests of its normalised prompts, answers and n-grams, each to its eval indices."""

    def __init__(self, held_out: Iterable[tuple[str, str]], n: int):
        self.n, self.size = n, 0
        self.prompts: dict[int, list[int]] = {}
        self.answers: dict[int, list[int]] = {}
        self.grams: dict[int, list[int]] = {}
        for i, (prompt, answer) in enumerate(held_out):
            self.size += 1
            for text, table in ((normalize(prompt), self.prompts), (normalize(answer), self.answers)):
                if text:
                    table.setdefault(digest(text), []).append(i)
                    for g in ngrams(words(text), n):
                        owners = self.grams.setdefault(g, [])
                        if not owners or owners[-1] != i:
                            owners.append(i)

    def match(self, prompt: str, answer: str) -> tuple[Sequence[int], Sequence[int], set[int]]:
        """Eval indices that a training example (normalised) matches: by prompt, by answer, by n-gram."""
        by_prompt = self.prompts.get(digest(prompt), ()) if prompt else ()
        by_answer = self.answers.get(digest(answer), ()) if answer else ()
        by_gram: set[int] = set()
        if self.grams:
            for text in (prompt, answer):
                for g in ngrams(words(text), self.n):
                    by_gram.update(self.grams.get(g, ()))
        return by_prompt, by_answer, by_gram


def check(train: Iterable[tuple[str, ...]], held_out: Iterable[tuple[str, str]], n: int = DEFAULT_N, *,
          dedup: bool = False, decontaminate: bool = False) -> Contamination:
    """Duplicates in `train` and its overlap with `held_out` (what is measured: docs/data.md, "Contamination").
    `train` is read once (it may stream); `held_out` is held in memory (the small side). A training item
    may carry a third string that is part of what makes it the same example (a preference pair's rejected
    answer, an unpaired completion's label) without taking part in the overlap. dedup and decontaminate only
    say what the caller does with the result: they appear in line(), to_json() and `dropped` (training
    indices, positions in the order given, sorted); nothing is changed here, and the eval set never is."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    index = _EvalIndex(held_out, n)
    first: dict[int, int] = {}
    duplicates, overlapping, dup_pairs, overlap_pairs = [], [], [], []
    exact_hit, gram_hit = set(), set()
    size = 0
    for i, (prompt, answer, *rest) in enumerate(train):
        size += 1
        prompt, answer = normalize(prompt), normalize(answer)
        extra = normalize(rest[0]) if rest else ""
        # the lengths keep ("a b", "c") apart from ("a", "b c")
        whole = digest(f"{len(prompt)}:{len(answer)}:{prompt}{answer}{extra}")
        original = first.setdefault(whole, i)
        if original != i:
            duplicates.append(i)
            if len(dup_pairs) < SHOWN:
                dup_pairs.append((i, original))
        by_prompt, by_answer, by_gram = index.match(prompt, answer)
        if by_prompt or by_answer or by_gram:
            overlapping.append(i)
            exact_hit.update(by_prompt, by_answer)
            gram_hit |= by_gram
            if len(overlap_pairs) < SHOWN:
                how = "prompt" if by_prompt else "answer" if by_answer else f"{n}-gram"
                overlap_pairs.append((min(by_prompt or by_answer or by_gram), i, how))
    return Contamination(n=n, train_size=size, eval_size=index.size, duplicates=duplicates,
                         eval_exact=sorted(exact_hit), eval_ngram=sorted(gram_hit), overlapping=overlapping,
                         dedup=dedup, decontaminate=decontaminate, duplicate_pairs=dup_pairs,
                         overlap_pairs=overlap_pairs)


# ---------------------------------------------------------------- records of a recipe's data


def _said(message: dict) -> str:
    """A message's text, with its tool calls written out (an answer that only calls a tool is its call)."""
    calls = message.get("tool_calls")
    text = message.get("content") or ""
    if not calls:
        return text
    written = "\n".join(call_json(c, sort_keys=True) for c in calls)
    return f"{text}\n{written}" if text else written


def texts(parsed: Parsed) -> tuple[str, str, str]:
    """(prompt, answer, the rest of what makes the example itself) of a parsed record: raw text is all answer;
    in a conversation the assistant turns are the answer and the user and tool turns the prompt. System turns
    are left out: one system prompt shared by a whole data set would otherwise make every example overlap
    every other. The rest: a preference pair's rejected answer, an unpaired completion's label."""
    if parsed.text is not None:
        return "", parsed.text, ""
    turns = [(m.get("role"), _said(m)) for m in parsed.messages]
    rest = (json.dumps([parsed.rejected, parsed.desirable]) if (parsed.rejected, parsed.desirable) != (None, None)
            else "")
    # an image is part of the prompt: the same question about another image is another example
    seen = [f"[image {image.digest()}]" for image in parsed.images]
    return ("\n".join([*(str(c) for role, c in turns if role not in ("assistant", "system")), *seen]),
            "\n".join(str(c) for role, c in turns if role == "assistant"), rest)


def of_records(train: Iterable[Record], held_out: Iterable[Record], cfg: DataConfig) -> Contamination:
    """`check` on a recipe's training and held-out records, parsed by its data format, with its dedup and
    decontaminate settings."""
    fmt = FORMATS[cfg.format]

    def items(records):
        return (texts(fmt.parse(r, cfg.fields)) for r in records)

    return check(items(train), [t[:2] for t in items(held_out)], dedup=cfg.dedup, decontaminate=cfg.decontaminate)


def screen(train: Iterable[Record], held_out: list[Record], cfg: DataConfig,
           train_where: Sequence[str]) -> tuple[set[int], dict]:
    """What data preparation does with a recipe's records: the training positions data.dedup and
    data.decontaminate drop, and the report for run.json (`train_where`: the training records' locations)."""
    found = of_records(train, held_out, cfg)
    return set(found.dropped), report(found, train_where, [r.where for r in held_out])


def report(found: Contamination, train_where: Sequence[str], held_where: Sequence[str]) -> dict:
    """`found.to_json()` with record locations ("file line N") in place of positions, for run.json."""
    out = found.to_json()
    out["duplicate_examples"] = [{"train": train_where[x["train"]], "copy_of": train_where[x["copy_of"]]}
                                 for x in out["duplicate_examples"]]
    out["overlap_examples"] = [{"eval": held_where[x["eval"]], "train": train_where[x["train"]], "match": x["match"]}
                               for x in out["overlap_examples"]]
    out["line"] = found.line()
    if found.train_size and len(found.dropped) > MANY * found.train_size:
        log.warning("data.dedup/data.decontaminate drop %d of %d training examples (%.0f%%): see the "
                    "contamination line's counts", len(found.dropped), found.train_size,
                    100 * len(found.dropped) / found.train_size)
    if found.train_size and len(found.dropped) == found.train_size:
        raise TunekitError(f"data.dedup/data.decontaminate drop all {found.train_size} training examples "
                           f"({found.line()}); set them to false or hold out other data")
    return out
