"""Near-duplicate prompts, by MinHash LSH (datasketch) over word 3-gram shingles: a synthetic prompt that
nearly repeats a human one, training or held out, or an earlier synthetic one, is found in sub-linear time."""

from __future__ import annotations

import re

from datasketch import MinHash, MinHashLSH

_WORDS = re.compile(r"\w+")


def shingles(text: str, n: int = 3) -> set[bytes]:
    """Lower-cased word n-grams (the whole text for a shorter one): punctuation and spacing do not count."""
    words = _WORDS.findall(text.lower())
    if len(words) <= n:
        return {" ".join(words).encode()}
    return {" ".join(words[i: i + n]).encode() for i in range(len(words) - n + 1)}


class NearDuplicates:
    """Texts by key; `near(text)` names the keys of those whose estimated Jaccard similarity reaches the
    threshold. Seeded, so the same texts give the same answers on every run (a resumed synthesis keeps the
    same set)."""

    def __init__(self, threshold: float = 0.7, num_perm: int = 128):
        self.num_perm = num_perm
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        self.exact: dict[str, str] = {}

    def _minhash(self, text: str) -> MinHash:
        m = MinHash(num_perm=self.num_perm, seed=1)
        m.update_batch(list(shingles(text)))
        return m

    @staticmethod
    def _normal(text: str) -> str:
        return " ".join(_WORDS.findall(text.lower()))

    def near(self, text: str) -> list[str]:
        hit = self.exact.get(self._normal(text))
        return [hit] if hit is not None else sorted(self.lsh.query(self._minhash(text)))

    def add(self, key: str, text: str) -> None:
        self.exact.setdefault(self._normal(text), key)
        if key not in self.lsh:
            self.lsh.insert(key, self._minhash(text))
