"""Stage `synthesize`: prompts written by the target itself, more training data from the model alone.

The chat template is rendered up to where the user's words begin and the target, sampled, writes them
(Magpie); `seeded` begins the turn with the first words of a human training prompt, so the target writes in
its topics and kinds; `mixed` alternates. A candidate is dropped when it is unfinished (no end of turn within
max_new_tokens), empty, too short or too long, a refusal or the assistant's voice, looping, holding role
markers, or a near duplicate (data/dedup.py) of a human prompt, training or held out, or of an earlier
synthetic one.

Candidates are generated `chunk_size` at a time from seeds fixed by (seed, chunk) (a server takes one per
candidate, hf one per batch, its first candidate's) and each chunk is kept on disk as it is written: a rerun
with the same generation settings reuses the chunks there and keeps the same set, and changing only the
filters re-judges them without generating again. A chunk closes with a line holding its candidates' count
and the hash of the lines above it, and is written to a temporary name, synced and renamed (so is the
settings' `fingerprint.json`): one cut short, at a line end or within a line, or altered, is generated again,
the log naming it and why, never reused as complete."""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from ...common.prompts_table import PROMPTS_SCHEMA
from ..errors import StageError
from ..files import atomic_file, hash_files, require_file, resolve, sha256_file, write_json
from ..target.chat import render
from ..target.model import load_tokenizer, weight_files
from .backends import Sampler, Settings, backend, degenerate
from .dedup import NearDuplicates

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.synthesize import SynthesizeArgs

SOURCE = "synthetic"
OPENING_TOKENS = 32  # a seeded opening's most tokens
_MARK = "\x00user-text\x00"
# An assistant's reflexes written into the user's turn: the target refusing, or answering instead of asking
_REFUSAL = re.compile(r"^\s*(i'?m sorry|i am sorry|sorry,|i cannot|i can'?t|as an ai|i'?m an ai|i am an ai|"
                      r"i'?m not able|i am not able|i apologi[sz]e)", re.I)
_ASSISTANT = re.compile(r"^\s*(sure[,!.]|certainly[,!.]|of course[,!.]|absolutely[,!.]|i'?m here to help|"
                        r"i am here to help|as an assistant|how can i (help|assist) you)", re.I)
_ROLE_MARKS = re.compile(r"<\|im_start\|>|<\|im_end\|>|\b(user|assistant|system)\s*:\s*$", re.I | re.M)
REASONS = ("unfinished", "empty", "too_short", "too_long", "refusal", "assistant_voice", "looping", "role_marks",
           "near_training_prompt", "near_held_out_prompt", "near_synthetic_prompt")


def user_turn_prefix(tok) -> str:
    """The template rendered up to where a user's words begin (its default system message included)."""
    text = render(tok, [{"role": "user", "content": _MARK}])
    if _MARK not in text:
        raise StageError("the chat template does not render a user message's text as given: the place where the "
                         "user's words begin cannot be found, so the target cannot be asked to write them")
    return text[: text.index(_MARK)]


def _read(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def _first_user(row: dict) -> str:
    return next((m["content"] for m in row["messages"] if m["role"] == "user"), "")


def _fingerprint(args: SynthesizeArgs, target: Path, train: Path) -> dict:
    """What decides the candidates (not the filters): a chunk kept on disk is reused only under the same."""
    return {"target": hash_files(weight_files(target))[:32], "train": sha256_file(train)[:32],
            **{k: getattr(args, k) for k in ("method", "seed_words", "temperature", "top_p", "seed",
                                            "max_new_tokens", "chunk_size", "dtype")}}


def _stale(path: Path, fp: dict) -> str | None:
    """Why the candidates kept next to fingerprint file `path` cannot be reused under settings `fp`, or None."""
    try:
        kept = json.loads(path.read_bytes())
    except FileNotFoundError:
        return f"{path} is missing"
    except (OSError, UnicodeDecodeError) as e:
        return f"{path} cannot be read ({e})"
    except json.JSONDecodeError as e:
        return f"{path} is torn or not JSON ({e.msg} at line {e.lineno}, column {e.colno})"
    if kept == fp:
        return None
    differ = sorted(k for k in fp if not isinstance(kept, dict) or kept.get(k) != fp[k])
    return f"they were made with other settings ({', '.join(differ) or 'other keys'} differ; {path})"


def write_chunk(path: Path, cands: list[dict]) -> None:
    """One chunk of candidates, a JSON line each, closed by the line `read_chunk` checks them against."""
    body = "".join(json.dumps(c) + "\n" for c in cands).encode()
    end = json.dumps({"chunk": {"count": len(cands), "sha256": hashlib.sha256(body).hexdigest()}}) + "\n"
    with atomic_file(path, fsync=True) as tmp:
        tmp.write_bytes(body + end.encode())


def read_chunk(path: Path) -> tuple[list[dict] | None, str]:
    """A chunk's candidates, or None and why it is not a complete chunk as `write_chunk` writes one."""
    try:
        data = path.read_bytes()
    except OSError as e:
        return None, f"cannot be read ({e.strerror})"
    if not data:
        return None, "is empty (cut short)"
    if not data.endswith(b"\n"):
        return None, "ends within a line (torn)"
    body, _, last = data[:-1].rpartition(b"\n")
    body = body + b"\n" if body else b""
    try:
        end = json.loads(last)["chunk"]
        count, digest = int(end["count"]), str(end["sha256"])
    except (ValueError, TypeError, KeyError):
        return None, ("does not end with the line holding its count and hash: cut short at a line end, or "
                      "written by an older version")
    lines = body.splitlines()
    if len(lines) != count:
        return None, f"holds {len(lines)} candidates where its last line says {count} (cut short)"
    if hashlib.sha256(body).hexdigest() != digest:
        return None, "does not match the hash on its last line (altered or damaged)"
    try:
        cands = [json.loads(x) for x in lines]
    except ValueError as e:
        return None, f"holds a line that is not JSON ({e})"
    if not all(isinstance(c, dict) and {"text", "ids", "capped"} <= set(c) for c in cands):
        return None, "holds a line that is not a candidate (text, ids, capped)"
    return cands, ""


def _judge(c: dict, args: SynthesizeArgs, dedup: NearDuplicates) -> str | None:
    text = c["text"].strip()
    words = len(text.split())
    if c["capped"]:
        return "unfinished"
    if not text:
        return "empty"
    if words < args.min_words:
        return "too_short"
    if words > args.max_words:
        return "too_long"
    if _REFUSAL.search(text):
        return "refusal"
    if _ASSISTANT.search(text):
        return "assistant_voice"
    if degenerate(c["ids"], min_len=16, min_distinct=0.5):
        return "looping"
    if _ROLE_MARKS.search(text):
        return "role_marks"
    near = dedup.near(text)
    if near:
        kind = near[0].split(":", 1)[0]
        return {"train": "near_training_prompt", "held": "near_held_out_prompt"}.get(kind, "near_synthetic_prompt")
    return None


class _Tokens:
    """The backends' progress hook, counting generated tokens (the stage's progress counts kept prompts)."""

    def __init__(self):
        self.tokens = 0

    def update(self, n: int, tokens: int = 0) -> None:
        self.tokens += tokens


def _write(out: Path, rows: list[dict]) -> str:
    with atomic_file(out, fsync=True) as tmp:  # what is published: whole on disk before it has its name
        pq.write_table(pa.Table.from_pylist(rows, schema=PROMPTS_SCHEMA), tmp)
    return sha256_file(out)[:32]


def run(workdir: str, args: SynthesizeArgs, reporter) -> None:
    out = resolve(workdir, args.out)
    train_path = require_file(resolve(workdir, args.train), "the human training prompts", "materialize prompts first")
    held = [require_file(resolve(workdir, p), "held-out prompts", "materialize prompts first") for p in args.held_out]
    human = _read(train_path)
    if args.count is None:
        args = args.model_copy(update={"count": round(args.per_training_prompt * len(human))})
    settings = {k: getattr(args, k) for k in ("count", "per_training_prompt", "method", "seed_words", "temperature",
                                              "top_p", "seed", "max_new_tokens", "min_words", "max_words",
                                              "dedup_threshold")}
    if args.count == 0:  # nothing asked for: no model is loaded
        version = _write(out, [])
        reporter.materialize(metadata={"path": str(out), "prompts": 0, "settings": settings}, data_version=version)
        return

    target = resolve(workdir, args.target)
    tok = load_tokenizer(target)
    from ..compute_dtype import choice, host_device, line

    dtype_info = choice(args.dtype, host_device(args.device))
    args = args.model_copy(update={"dtype": dtype_info["dtype"]})
    reporter.log(line(dtype_info))
    dedup = NearDuplicates(args.dedup_threshold)
    for i, r in enumerate(human):  # by position: ids need not be unique across sources
        dedup.add(f"train:{i}", _first_user(r))
    held_rows = [r for p in held for r in _read(p)]
    for i, r in enumerate(held_rows):
        dedup.add(f"held:{i}", _first_user(r))
    seeds = [t.split() for t in map(_first_user, human) if len(t.split()) >= 2]
    if args.method != "magpie" and not seeds:
        raise StageError(f"method {args.method} begins prompts with human ones, but {train_path} holds none")
    prefix = tok(user_turn_prefix(tok), add_special_tokens=False)["input_ids"]

    parts = out.with_name(out.name + ".parts")
    fp, fp_path = _fingerprint(args, target, train_path), parts / "fingerprint.json"
    stale = _stale(fp_path, fp) if parts.exists() else "none kept"
    if stale and parts.exists():
        reporter.log(f"the candidates kept in {parts} cannot be reused: {stale}: generating afresh")
        shutil.rmtree(parts)
    if stale:
        parts.mkdir(parents=True, exist_ok=True)
        write_json(fp_path, fp, fsync=True)

    max_chunks = -(-int(args.count * args.max_candidates_per_prompt) // args.chunk_size)
    kept, filtered, examples, candidates = [], Counter(), {}, 0
    tokens, reused, redone, t0 = _Tokens(), 0, 0, time.monotonic()
    sampler = Sampler("synthetic", args.temperature, args.top_p, args.seed)
    reporter.log(f"writing {args.count} prompts with {target.name} ({args.method}, temperature {args.temperature}, "
                 f"top_p {args.top_p}) on {args.backend}; {len(human)} training and {len(held_rows)} held-out human "
                 f"prompts to keep clear of")
    with backend(Settings.of(args, max_model_len=len(prefix) + OPENING_TOKENS + args.max_new_tokens), target, tok, out.parent,
                 reporter) as complete, reporter.progress("synthesize", args.count, unit="prompts") as prog:
        for chunk in range(max_chunks):
            if len(kept) >= args.count:
                break
            path = parts / f"chunk-{chunk:05d}.jsonl"
            cands, why = read_chunk(path) if path.exists() else (None, "")
            if cands is not None:
                reused += 1
            else:
                if why:  # never reused as it is: a short chunk would change the set published
                    reporter.log(f"candidate chunk {path} {why}: generating it again", level="warning")
                    redone += 1
                cands = _generate(complete, chunk, args, prefix, seeds, tok, sampler, tokens)
                write_chunk(path, cands)
            before = len(kept)
            for i, c in enumerate(cands):
                candidates += 1
                why = _judge(c, args, dedup)
                if why is None:
                    pid = f"syn-{chunk:05d}-{i:04d}"
                    dedup.add(f"syn:{pid}", c["text"])
                    kept.append({"id": pid, "source": SOURCE, "messages": [{"role": "user", "content": c["text"].strip()}],
                                 "num_user_turns": 1})
                    if len(kept) >= args.count:
                        break
                else:
                    filtered[why] += 1
                    examples.setdefault(why, c["text"][:160])
            prog.update(len(kept) - before, tokens=0)
    wall = time.monotonic() - t0
    if len(kept) < args.count:
        raise StageError(
            f"only {len(kept)} of the {args.count} prompts asked for passed the filters after {candidates} candidates "
            f"(max_candidates_per_prompt {args.max_candidates_per_prompt:g}); dropped: {dict(filtered)}. Lower count, "
            "raise max_candidates_per_prompt, or loosen the filter that drops most (the candidates written so far "
            f"are kept in {parts} and reused)")
    version = _write(out, kept)
    reporter.materialize(metadata={
        "path": str(out), "prompts": len(kept), "candidates": candidates, "kept_share": round(len(kept) / candidates, 4),
        **{f"dropped_{r}": filtered[r] for r in REASONS},
        "generated_tokens": tokens.tokens, "chunks_reused": reused,
        "chunks_regenerated": redone, "wall_s": round(wall, 2),
        "prompts_per_s": round(len(kept) / max(wall, 1e-9), 3),
        "mean_words": round(sum(len(r["messages"][0]["content"].split()) for r in kept) / len(kept), 1),
        "settings": settings, **dtype_info,
        "examples_kept": [r["messages"][0]["content"][:160] for r in random.Random(0).sample(kept, min(5, len(kept)))],
        "examples_dropped": examples,
    }, data_version=version)


def _generate(complete, chunk: int, args: SynthesizeArgs, prefix: list[int], seeds: list[list[str]], tok,
              sampler: Sampler, tokens: _Tokens) -> list[dict]:
    """One chunk of candidates, each with its own sampling seed and (seeded) its own human opening words."""
    rng = random.Random(hashlib.sha256(f"{args.seed}:{chunk}".encode()).digest())
    prompts, openings = [], []
    for i in range(args.chunk_size):
        seeded = args.method == "seeded" or (args.method == "mixed" and i % 2 == 1)
        opening, ids = "", []
        if seeded:
            words = rng.choice(seeds)
            # at most half the prompt (its whole text as the opening would copy it), and a bounded number of
            # tokens (the server is sized for them: a long "word", a URL, would not fit)
            ids = tok(" ".join(words[: min(args.seed_words, len(words) // 2)]), add_special_tokens=False)["input_ids"]
            ids = ids[:OPENING_TOKENS]
            opening = tok.decode(ids)
        openings.append(opening)
        prompts.append(prefix + ids)
    base = args.seed * 1_000_003 + chunk * args.chunk_size
    done = complete(prompts, [base + i for i in range(len(prompts))], sampler, tokens)
    return [{"text": o + c.text, "ids": c.ids, "capped": c.capped, "opening": o} for o, c in zip(openings, done)]
