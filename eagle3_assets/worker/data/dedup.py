"""Near-duplicate prompts, by MinHash LSH (datasketch) over character 5-gram shingles of the normalised text: a
synthetic prompt that nearly repeats a human one, training or held out, or an earlier synthetic one, is found
in sub-linear time. Character shingles, not word ones: prompts are short, and one word changed in a 16-word
prompt leaves its word 3-grams at Jaccard ~0.65, under the threshold, where its character 5-grams stay ~0.85
(measured on the shipped prompts)."""

from __future__ import annotations

import re

from datasketch import MinHash, MinHashLSH

_WORDS = re.compile(r"\w+")


def normal(text: str) -> str:
    """Lower case, words only, single spaces: case, punctuation and spacing do not make a prompt new."""
    return " ".join(_WORDS.findall(text.lower()))


def shingles(text: str, n: int = 5) -> set[bytes]:
    """Character n-grams of the normalised text (the whole of a shorter one)."""
    t = normal(text)
    if len(t) <= n:
        return {t.encode()}
    return {t[i: i + n].encode() for i in range(len(t) - n + 1)}


class NearDuplicates:
    """Texts by key; `near(text)` names the keys of those whose Jaccard similarity of shingles reaches the
    threshold, most similar first. LSH finds candidates at a lower threshold (its S-curve lets through only
    about half of the pairs right at its own threshold), each is then checked on the shingles themselves: no
    false negative near the threshold, and the same answers on every run (a resumed synthesis keeps its set)."""

    def __init__(self, threshold: float = 0.7, num_perm: int = 128):
        self.threshold, self.num_perm = threshold, num_perm
        self.lsh = MinHashLSH(threshold=max(0.3, threshold - 0.25), num_perm=num_perm)
        self.exact: dict[str, str] = {}
        self.sets: dict[str, set[bytes]] = {}

    def _minhash(self, grams: set[bytes]) -> MinHash:
        m = MinHash(num_perm=self.num_perm, seed=1)
        m.update_batch(list(grams))
        return m

    def near(self, text: str) -> list[str]:
        hit = self.exact.get(normal(text))
        if hit is not None:
            return [hit]
        grams = shingles(text)
        sims = [(len(grams & self.sets[k]) / len(grams | self.sets[k]), k) for k in self.lsh.query(self._minhash(grams))]
        return [k for sim, k in sorted(sims, key=lambda x: (-x[0], x[1])) if sim >= self.threshold]

    def add(self, key: str, text: str) -> None:
        self.exact.setdefault(normal(text), key)
        if key not in self.sets:
            self.sets[key] = grams = shingles(text)
            self.lsh.insert(key, self._minhash(grams))
