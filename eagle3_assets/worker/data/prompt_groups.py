"""The cheap keys served prompts are grouped by, so that a drift report can say *where* acceptance fell: the length of
the user's text (a bucket), the first words of the last user turn, and a kind read off the text by rules (no model,
no download, the same answer on every machine):

- `structured`: the prompt carries a block of data (JSON, YAML, CSV or a table, log lines, key=value records), or a
  fenced block tagged json / yaml / csv / xml / toml;
- `other-language`: not English (another script, or other languages' function words outnumbering English's);
- `code`: a fenced block, lines of code, or a request about programming;
- `math`: arithmetic, equations or a maths vocabulary;
- `prose`: the rest (questions, writing, advice).

Checked in that order: a JSON record pasted into a question about Python is `structured`, because what the drafter
must predict is mostly data. Rules, not a classifier: a drafter's drift shows as a kind of prompt it never saw, and a
kind a user can read and check is worth more here than a finer one."""

from __future__ import annotations

import json
import re
from collections import defaultdict

from ...common.prompts_table import served_acceptance_length
from .dedup import normal

GROUP_BY = ("kind", "length_bucket", "first_words")
BUCKETS = ((256, "<256"), (1024, "256-1k"), (4096, "1k-4k"))  # characters of user text; longer: "4k+"
FIRST_WORDS = 3
KINDS = ("structured", "other-language", "code", "math", "prose")

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)")
_DATA_FENCES = {"json", "jsonl", "yaml", "yml", "csv", "tsv", "xml", "toml", "ini", "log"}
_CODE_LINE = re.compile(r"^\s*(def |class |import |from \S+ import |#include|function\b|const |let |var |public |"
                        r"private |return\b|for\s*\(|while\s*\(|if\s*\(|SELECT |INSERT |CREATE TABLE|fn |package |"
                        r"@\w+|\}\s*$|print\()")
_CODE_WORDS = re.compile(r"\b(python|javascript|typescript|java|rust|golang|c\+\+|sql|regex|function|compile[rd]?|"
                         r"debug|bug|stack ?trace|api|script|bash|shell|html|css|class|method|variable|array|"
                         r"recursion|recursive|algorithm|code)\b", re.I)
_MATH = re.compile(r"\d\s*[-+*/^×÷=<>]\s*\(?\d|\b(solve|equation|integral|derivative|probability|prime|factor|"
                   r"sum of|percent|fraction|triangle|area of|how many)\b", re.I)
_DATA_CHARS = set('{}[]",:=|\t;')
_LOG_LINE = re.compile(r"^\s*\[?\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}")
_KEY_VALUE = re.compile(r"^\s*[\"']?[\w.-]+[\"']?\s*[:=]\s*\S")
# Function words: a few hundred characters of text hold several of its language's.
_ENGLISH = set("the a an is are was of to and in that it for on with as what how why i you my your can do does be "
               "this which when where who me we please give write tell".split())
_OTHER = set("le la les des est une un et pour avec dans qui que pas du au sur ce cette comment pourquoi quel quelle "
             "der die das und ist nicht ein eine ich du wie warum was mit für auf dem den zu sie es "
             "el los las es una y por con para cómo qué por qué del se lo su "
             "il di che è non per con gli della sono come perché "
             "os uma é não com para como porque da em "
             "sont mon ma je tu vous nous peux moi qu mes ses leur "
             "mir mich im von bei einen kann man sind gibt wir ihr "
             "yo mi tu muy más pero como cuál son "
             "un lo sul nel della delle dei cosa devo scrivi descrivi spiegami perché breve tre frasi "
             "sobre uma dá-me explica-me três estudar de modo semplice forma simples".split()) - _ENGLISH


def user_text(messages: list[dict]) -> str:
    return "\n".join(m["content"] for m in messages if m["role"] == "user")


def length_bucket(chars: int) -> str:
    return next((name for limit, name in BUCKETS if chars < limit), "4k+")


def first_words(messages: list[dict]) -> str:
    last = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    return " ".join(normal(last).split()[:FIRST_WORDS])


def _data_line(line: str) -> bool:
    s = line.strip()
    if len(s) < 3:
        return s in ("{", "}", "[", "]", "},", "],")
    marks = sum(c in _DATA_CHARS for c in s)
    return bool(_LOG_LINE.match(s)) or marks >= 3 or (s.count(",") >= 2 and not s.endswith((".", "?", "!"))) or \
        (bool(_KEY_VALUE.match(s)) and len(s.split()) <= 6)


def _other_language(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    if letters and sum(not ("a" <= c.lower() <= "z") and c.lower() not in "àâäçéèêëîïôöùûüÿñáíóúãõœß"
                       for c in letters) / len(letters) > 0.3:
        return True  # another script: Cyrillic, CJK, Arabic, Greek ...
    words = normal(text).split()
    english, other = sum(w in _ENGLISH for w in words), sum(w in _OTHER for w in words)
    other += any(c in "àâäçéèêëîïôöùûüÿñáíóúãõœß" for c in text.lower())  # accents English rarely has
    return other >= 2 and other > english


def kind(text: str) -> str:
    """One of KINDS for a prompt's user text."""
    fences = [tag.lower() for tag in _FENCE.findall(text)]
    if any(tag in _DATA_FENCES for tag in fences):
        return "structured"
    lines = [line for line in text.splitlines() if line.strip()]
    data = sum(_data_line(line) for line in lines)
    code = sum(bool(_CODE_LINE.match(line)) for line in lines)
    if data >= 3 and data >= 0.4 * len(lines) and data > code:
        return "structured"
    if _other_language(text):
        return "other-language"
    if fences or code >= 2 or _CODE_WORDS.search(text):
        return "code"
    if _MATH.search(text):
        return "math"
    return "prose"


def keys(messages: list[dict]) -> dict:
    """The group keys of one prompt: kind, length bucket, first words (and the user text's length)."""
    text = user_text(messages)
    return {"kind": kind(text), "length_bucket": length_bucket(len(text)), "first_words": first_words(messages),
            "user_chars": len(text)}


def group_value(row: dict, key: str):
    """A traffic row's value of a group key: one of GROUP_BY's, or a gateway field kept in `gateway_fields`."""
    return row.get(key) if key in GROUP_BY else json.loads(row.get("gateway_fields") or "{}").get(key)


def served_groups(rows: list[dict], by: list[str], min_group: int) -> dict:
    """Acceptance as production served it: over the rows (a traffic day's) that carry served figures, overall and
    per group of each key of `by` (GROUP_BY's, or a gateway field in `gateway_fields`) with at least `min_group` such
    requests, lowest first. Each figure is vLLM's: 1 + drafts accepted / verify steps, summed over the requests, so a
    long answer weighs as its steps do (as the server's own counters weigh it)."""
    served = [r for r in rows if r.get("served_steps")]
    out = []
    for key in by:
        acc = defaultdict(lambda: [0, 0, 0])  # requests, steps, accepted
        for r in served:
            value = group_value(r, key)
            if value is not None:
                a = acc[value]
                a[0], a[1], a[2] = a[0] + 1, a[1] + r["served_steps"], a[2] + r["served_accepted"]
        out += [{"by": key, "value": value, "requests": n, "share": round(n / len(served), 4), "steps": steps,
                 "acceptance_length": served_acceptance_length(steps, accepted)}
                for value, (n, steps, accepted) in acc.items() if n >= min_group]
    steps = sum(r["served_steps"] for r in served)
    return {"requests": len(served), "steps": steps,
            "acceptance_length": served_acceptance_length(steps, sum(r["served_accepted"] for r in served)),
            "groups": sorted(out, key=lambda g: (g["acceptance_length"], -g["requests"]))}
