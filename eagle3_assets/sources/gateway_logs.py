"""The serving gateway's request logs, one day at a time, for the `traffic` asset: read, placed in their day, sampled
and redacted on the Dagster machine, so that only redacted text goes further.

What is read: files of one request per line (.jsonl or .ndjson, optionally .gz; .json and .parquet files are read
too, as the `prompts` asset reads them), from local paths or fsspec URLs, globs allowed (`s3://logs/gw-*.jsonl.gz`).
A line is an OpenAI chat-completions request body (`{"model": ..., "messages": [...]}`), or a gateway's record
holding it under `body` or `request` (as an object, or as the body's JSON text), beside a timestamp. The messages
are read by the `prompts` asset's rules (prompt_sources.py: text content parts joined, a bad line named by file
and line), with what chat traffic adds: role `developer` is a system turn, `tool` and `function` results are
dropped (the target answers the user, not a tool call), and so are the assistant turns emptied by that.

The day: the record's first field of `timestamp_fields` that is present, as epoch seconds (a number, or digits in
a string) or an ISO 8601 time (`2026-12-02T10:00:00Z`, `...+01:00`; a time without an offset is UTC); the
partition's window (UTC days unless the partitions' time zone is set) decides. A request with no timestamp is
placed by the date in its file's name (`gateway-2026-12-02.jsonl`, `20261202`); with none there either, it is a
bad record. A file whose name carries a date more than a day away from the partition's is not opened.

What production served: a record that holds the response beside the request (under `response` or `response_body`,
as an object or its JSON text: the chat completion, or a stream's last chunk) carries, when vLLM serves with
`--per-request-spec-decode-metrics summary`, that request's own speculative steps and draft tokens accepted and
proposed (`metrics.speculative_decoding`); they are kept with the request (`served_*`), so that a day's traffic says
where production accepted fewer drafts, at no GPU cost. A log of requests alone carries none: the drift report then
replays the day. `fields`: the record's fields a team names (`tenant`, `route`, or a dotted path `metadata.tenant`),
kept redacted beside the request, so that acceptance can be cut by them.

The sample: every request of the day is ranked by a hash of the seed and its turns (stable: the same logs give the
same sample, and more requests never swap out a kept one for one ranked after it); exact repeats are dropped as the
candidates are chosen; only the first `keep` by rank are held in memory and redacted (redact.py)."""

from __future__ import annotations

import fnmatch
import getpass
import hashlib
import heapq
import json
import math
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from pathlib import PurePosixPath

import fsspec

from .prompt_files import Conversation, LoadStats, PromptError, clean, iter_records, json_kind, to_messages
from .redact import Redactor

TIMESTAMP_FIELDS = ["timestamp", "time", "created", "created_at", "start_time"]
BODY_FIELDS = ("body", "request")
RESPONSE_FIELDS = ("response", "response_body")
SPEC_METRICS = {"num_spec_steps": "served_steps", "num_accepted_draft_tokens": "served_accepted",
                "num_draft_tokens": "served_drafted", "num_spec_tokens": "served_k"}  # vLLM's names -> ours
FIELD_CHARS = 64  # a named field's value is cut to this after redaction: a key to group by, not a payload
ROLE_ALIASES = {"developer": "system"}
TOOL_ROLES = {"tool", "function", "ipython"}
_NAME_DATE = re.compile(r"(?<!\d)(\d{4})-?(\d{2})-?(\d{2})(?!\d)")
_MAX_EPOCH = 7_258_118_400  # 2200-01-01: a larger number is milliseconds or nanoseconds, not seconds
_WILDCARD = re.compile(r"[*?\[]")
_DIRS_CHECKED = 1000  # a glob's walk for an unsearchable directory stops after this many (a huge tree, a link loop)


class TrafficError(PromptError):
    """Bad traffic input or settings; the message names the file, the line and the fix, never a raw value."""


@dataclass
class TrafficStats(LoadStats):
    files_read: list[str] = field(default_factory=list)
    files_skipped_by_name: int = 0
    in_day: int = 0
    other_days: Counter = field(default_factory=Counter)  # date -> requests
    placed_by_file_name: int = 0
    no_user_message: int = 0
    tool_messages_dropped: int = 0
    exact_duplicates: int = 0
    redacted: Counter = field(default_factory=Counter)
    with_served: int = 0  # requests of the day whose logged response carried per-request speculative figures


@dataclass
class Candidate:
    rank: int
    conv: Conversation
    timestamp: float | None
    served: dict | None = None  # SPEC_METRICS' values: what production served this request
    fields: dict = field(default_factory=dict)  # the named fields' raw values (redacted with the text)


def expand(sources: list[str]) -> list[str]:
    """Each source as the files it names: a glob by fsspec's own matching (sorted), a plain path or URL as itself."""
    out = []
    for source in sources:
        try:
            fs, _, paths = fsspec.get_fs_token_paths(source)
        except (ImportError, ValueError) as e:  # an unknown protocol, or its backend not installed
            raise TrafficError(f"traffic source {source!r}: {e}: use a local path or a URL fsspec reads (s3://, "
                               "gs://, ... with its backend installed on the Dagster machine)") from None
        glob = any(c in source for c in "*?[")
        if not paths or (not glob and not fs.exists(paths[0])):
            if denied := _local_denied(fs, paths[0] if paths else source, glob):
                raise TrafficError(f"traffic source {source!r}: permission denied: {denied}: give the user running "
                                   f"Dagster ({getpass.getuser()}) read and execute (search) permission on it (e.g. "
                                   "through its group), or copy the logs where it can read them")
            raise TrafficError(f"traffic source {source!r} {'matches no file' if glob else 'not found'}: check the "
                               "traffic asset's `sources` (or EAGLE3_TRAFFIC_LOGS); paths and globs are read on the "
                               "Dagster machine")
        out += [source] if not glob else [p if "://" not in source else fs.unstrip_protocol(p) for p in sorted(paths)]
    return out


def _local_denied(fs, path: str, glob: bool) -> str | None:
    """Why a local path that seems absent is in fact out of reach, or None: a directory on its way that the user
    cannot search (no x bit: exists() and glob() then say nothing is there, even where the directory can be listed,
    as one of mode 0444 can), or a glob's directory that it cannot list."""
    if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return None
    parts = PurePosixPath(os.path.abspath(fs._strip_protocol(path))).parts
    # the directories before the first wildcard (a plain path's: all but its last part) must be searched
    wild = next((i for i, part in enumerate(parts) if _WILDCARD.search(part)), len(parts) - 1) if glob else \
        len(parts) - 1
    for i in range(1, wild + 1):
        d = os.path.join(*parts[:i])
        if not os.path.isdir(d):  # truly absent (or not a directory): the caller's "not found" stands
            return None
        if not os.access(d, os.X_OK):
            return _cannot(d, "searched")
    if glob:  # then listed, and so is each directory the glob's wildcards reach before its last part
        return _walk_denied(os.path.join(*parts[:wild]), parts[wild:-1], [_DIRS_CHECKED])
    try:
        os.stat(os.path.join(*parts))
    except PermissionError as e:  # refused where the mode bits allow it (an ACL, a security module)
        return f"{e.filename or path} cannot be reached ({e.strerror.lower()})"
    except OSError:
        return None
    return None


def _cannot(d: str, what: str) -> str:
    return f"{d} cannot be {what} (mode {os.stat(d).st_mode & 0o7777:04o})"


def _walk_denied(d: str, parts: tuple, budget: list) -> str | None:
    """The first directory that cannot be listed or searched: `d` (listed for the glob's next part), or one that the
    glob's remaining directory parts (`*`, `day-*`, `**`) reach below it; None if there is none."""
    try:
        names = sorted(os.listdir(d))
    except PermissionError:
        return _cannot(d, "listed")
    except OSError:
        return None
    if not parts:
        return None
    if parts[0] == "**" and (why := _walk_denied(d, parts[1:], budget)):  # '**' may match no directory
        return why
    for name in names:
        sub = os.path.join(d, name)
        if (parts[0] != "**" and not fnmatch.fnmatchcase(name, parts[0])) or not os.path.isdir(sub):
            continue
        budget[0] -= 1
        if budget[0] < 0:
            return None
        if not os.access(sub, os.X_OK):
            return _cannot(sub, "searched")
        if why := _walk_denied(sub, parts if parts[0] == "**" else parts[1:], budget):
            return why
    return None


def name_date(url: str) -> date | None:
    for m in _NAME_DATE.finditer(PurePosixPath(url).name):
        try:
            return date(int(m[1]), int(m[2]), int(m[3]))
        except ValueError:
            continue
    return None


def request_time(rec: dict, fields: list[str], place: str) -> datetime | None:
    """The first of `fields` present in the record, as an aware datetime; None when none is."""
    for f in fields:
        v = rec.get(f)
        if v is None:
            continue
        if isinstance(v, str) and re.fullmatch(r"\s*\d+(\.\d+)?\s*", v):
            v = float(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if not math.isfinite(v) or not 0 <= v < _MAX_EPOCH:
                raise TrafficError(f"{place}: {f} {v!r} is not epoch seconds (past the year 2200: milliseconds? "
                                   "write seconds, or an ISO 8601 time); fix the gateway's log, or set "
                                   "on_bad_record='skip'")
            return datetime.fromtimestamp(v, timezone.utc)
        if isinstance(v, str):
            s = v.strip()
            try:
                t = datetime.fromisoformat(s[:-1] + "+00:00" if s[-1:] in "Zz" and s else s)
            except ValueError:
                raise TrafficError(f"{place}: {f} {v[:40]!r} is neither epoch seconds nor an ISO 8601 time (like "
                                   "2026-12-02T10:00:00Z); fix the gateway's log, or set on_bad_record='skip'") from None
            return t if t.tzinfo else t.replace(tzinfo=timezone.utc)
        raise TrafficError(f"{place}: {f} is {json_kind(v)}: expected epoch seconds or an ISO 8601 time; fix the "
                           "gateway's log, or set on_bad_record='skip'")
    return None


def request_body(rec: dict, place: str) -> dict:
    """The chat-completions body: the record itself, or what a gateway's record holds under `body` / `request`."""
    return _json_field(rec, BODY_FIELDS, place, "a JSON request body") or rec


def _json_field(rec: dict, names: tuple[str, ...], place: str, what: str) -> dict | None:
    """The first of `names` the record holds as an object, or as the JSON text of one; None when it holds none."""
    for k in names:
        v = rec.get(k)
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise TrafficError(f"{place}: {k!r} is text that is not {what} ({e.msg} at column {e.colno}); fix "
                                   "that line, or set on_bad_record='skip'") from None
        if isinstance(v, dict):
            return v
    return None


def served_figures(rec: dict, place: str) -> dict | None:
    """The request's speculative figures from the response logged with it (`metrics.speculative_decoding`, vLLM's
    per-request metrics), or None when the record holds no response or the response none."""
    resp = _json_field(rec, RESPONSE_FIELDS, place, "a JSON response body")
    metrics = (resp or {}).get("metrics")
    spec = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if not isinstance(spec, dict):
        return None
    out = {}
    for theirs, ours in SPEC_METRICS.items():
        v = spec.get(theirs)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TrafficError(f"{place}: response metrics.speculative_decoding.{theirs} is {json_kind(v)}, not a "
                               "count: the response was not logged as vLLM returned it; fix the gateway's log, or "
                               "set on_bad_record='skip'")
        out[ours] = v
    if out["served_accepted"] > out["served_drafted"]:
        raise TrafficError(f"{place}: response metrics.speculative_decoding counts more draft tokens accepted "
                           f"({out['served_accepted']}) than proposed ({out['served_drafted']}): the figures are not "
                           "vLLM's; fix the gateway's log, or set on_bad_record='skip'")
    return out


def named_fields(rec: dict, names: list[str]) -> dict:
    """The record's fields a team named (`tenant`, `metadata.tenant`: a dotted path), as text; absent ones left out.
    An object or a list is no key to group by: left out too."""
    out = {}
    for name in names:
        v = rec
        for part in name.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        if isinstance(v, (str, int, float)) and not isinstance(v, bool):
            out[name] = str(v)
    return out


def request_messages(body: dict, place: str, stats: TrafficStats) -> list[dict]:
    msgs = body.get("messages")
    if isinstance(msgs, list) and all(isinstance(m, dict) for m in msgs):
        kept = [m for m in msgs if str(m.get("role")).lower() not in TOOL_ROLES]
        stats.tool_messages_dropped += len(msgs) - len(kept)
        body = {"messages": [{**m, "role": ROLE_ALIASES.get(str(m.get("role")).lower(), m.get("role"))}
                             for m in kept]}
    return to_messages(body, place)


def read_day(sources: list[str], start: datetime, end: datetime, *, seed: int, keep: int, max_user_turns: int,
             on_bad_record: str, timestamp_fields: list[str], stats: TrafficStats,
             redactor: Redactor, fields: list[str] = ()) -> list[Candidate]:
    """The `keep` requests of [start, end) ranked first, each a conversation of raw text (held here only), in
    rank order. A bad record fails (a TrafficError whose message is redacted) or, with on_bad_record 'skip', is
    counted and its redacted problem kept in `stats.problems`."""
    day = start.date()
    pool: dict[str, Candidate] = {}
    heap: list[tuple[int, str]] = []  # (-rank, key): the worst-ranked candidate on top
    for url in expand(sources):
        named = name_date(url)
        if named is not None and abs((named - day).days) > 1:
            stats.files_skipped_by_name += 1
            continue
        stats.files_read.append(url)
        try:
            for place, rec in iter_records(url):
                stats.records += 1
                try:
                    cand = _candidate(place, rec, named, start, end, seed, max_user_turns, timestamp_fields, stats,
                                      fields)
                except PromptError as e:
                    if on_bad_record != "skip":
                        raise
                    stats.bad_records_skipped += 1
                    stats.problems.append(redactor.redact(str(e))[0])
                    continue
                if cand is None:
                    continue
                key = cand.conv.key
                if key in pool:
                    stats.exact_duplicates += 1
                elif len(heap) < keep:
                    heapq.heappush(heap, (-cand.rank, key))
                    pool[key] = cand
                elif cand.rank < -heap[0][0]:
                    del pool[heapq.heapreplace(heap, (-cand.rank, key))[1]]
                    pool[key] = cand
        except PromptError as e:  # its text may quote a value of the log: only the redacted one goes on
            raise TrafficError(redactor.redact(str(e))[0]) from None
    return sorted(pool.values(), key=lambda c: c.rank)


def _candidate(place: str, rec, named: date | None, start: datetime, end: datetime, seed: int,
               max_user_turns: int, time_fields: list[str], stats: TrafficStats,
               fields: list[str] = ()) -> Candidate | None:
    if isinstance(rec, PromptError):  # a line that is not a record (bad bytes, malformed JSON)
        raise rec
    if not isinstance(rec, dict):
        to_messages(rec, place)  # raises, naming what the line holds
    t = request_time(rec, time_fields, place)
    if t is None:
        if named is None:
            raise TrafficError(f"{place}: no timestamp (none of the fields {time_fields}) and the file's name carries no "
                               "date (like gateway-2026-12-02.jsonl): the request's day is unknown. Log a timestamp, "
                               "name the files by day, set timestamp_fields, or set on_bad_record='skip'")
        in_day, when = named == start.date(), None
        stats.placed_by_file_name += in_day
    else:
        in_day, when = start <= t < end, t.timestamp()
    if not in_day:
        stats.other_days[str(t.astimezone(start.tzinfo).date() if t else named)] += 1
        return None
    stats.in_day += 1
    msgs = request_messages(request_body(rec, place), place, stats)
    if not any(m["role"] == "user" and m["content"].strip() for m in msgs):
        stats.no_user_message += 1  # a tool round or a system-only call: traffic, but no prompt to answer
        return None
    msgs = clean(msgs, place, max_user_turns, sys.maxsize, stats)  # truncated after redaction (a cut key leaks)
    served = served_figures(rec, place)
    stats.with_served += served is not None
    conv = Conversation(id="", source="traffic", messages=msgs)
    rank = int(hashlib.sha256(f"{seed}\0{conv.key}".encode()).hexdigest()[:16], 16)
    return Candidate(rank, conv, when, served, named_fields(rec, list(fields)))


def redacted_rows(cands: list[Candidate], redactor: Redactor, max_message_chars: int,
                  stats: TrafficStats) -> list[dict]:
    """The candidates as the stage reads them: each message redacted, then cut to max_message_chars; the id a hash
    of the redacted turns (no gateway id is kept: it may carry anything)."""
    rows = []
    for c in cands:
        msgs = []
        for m in c.conv.messages:
            text, found = redactor.redact(m["content"])
            stats.redacted.update(found)
            if len(text) > max_message_chars:
                text = text[:max_message_chars]
                stats.messages_truncated += 1
            msgs.append({"role": m["role"], "content": text})
        conv = Conversation(id="", source=c.conv.source, messages=msgs)
        named = {}
        for k, v in c.fields.items():
            text, found = redactor.redact(v)
            stats.redacted.update(found)
            named[k] = text[:FIELD_CHARS]
        rows.append({"id": conv.key[:16], "source": conv.source, "messages": msgs,
                     "num_user_turns": sum(m["role"] == "user" for m in msgs), "timestamp": c.timestamp,
                     **(c.served or dict.fromkeys(SPEC_METRICS.values())),
                     "gateway_fields": json.dumps(named, ensure_ascii=False) if named else None})
    return rows
