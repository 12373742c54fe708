"""Stage `generate`: the target regenerates every assistant turn of the training prompts, so the drafter
learns the target's own distribution, on any backend of backends.py (hf in the worker, or a serving engine).

Each prompt gets a greedy reply (the kind serving measures) and, with `responses_per_prompt` > 1, sampled
ones: more of the target's own text from the same prompts. A reply is kept as the target produced it: the
prompt ids it was fed, then its own tokens, its end-of-turn token only where it emitted one (a reply cut at
max_new_tokens ends there, with no marker the target never wrote for the drafter to learn)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import StageError
from ..files import atomic_file, require_file, resolve, sha256_file
from ..target.chat import render, training_sequence
from ..target.model import load_tokenizer
from .backends import Completion, Sampler, Settings, backend, degenerate

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.generate import GenerateArgs

SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("kind", pa.string()),  # greedy | sampled
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    ("num_loss_tokens", pa.int32()),
    ("generated_tokens", pa.int32()),
    ("truncated_turns", pa.int32()),
])
KINDS = ("greedy", "sampled")


@dataclass
class Reply(Completion):
    prompt_too_long: bool = False  # the history was cut to max_prompt_tokens


class _Conv:
    def __init__(self, row: dict, kind: Sampler, variant: int):
        # variant 0 is the prompt's greedy reply and keeps its id; sampled variants are "<id>~s<k>"
        self.id = row["id"] if variant == 0 else f"{row['id']}~s{variant}"
        self.source, self.kind, self.variant = row["source"], kind, variant
        # Original assistant turns are dropped: every user turn gets the target's own reply.
        self.todo = [m for m in row["messages"] if m["role"] in ("system", "user")]
        self.out: list[dict] = []
        self.replies: list[Reply] = []

    def next_prompt(self) -> list[dict] | None:
        while self.todo:
            m = self.todo.pop(0)
            self.out.append(m)
            if m["role"] == "user":
                return self.out
        return None

    @property
    def seed(self) -> int:
        """Each sampled variant its own seed (a server takes it per request; hf, per batch of its first)."""
        return self.kind.seed + 1_000_003 * self.variant


def _prompt_ids(tok, messages: list[dict], max_prompt_tokens: int) -> tuple[list[int], bool]:
    ids = tok(render(tok, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    return ids[-max_prompt_tokens:], len(ids) > max_prompt_tokens


def run(workdir: str, args: GenerateArgs, reporter) -> None:
    prompts = require_file(resolve(workdir, args.prompts), "training prompts",
                           "materialize the prompts asset first")
    out = resolve(workdir, args.out)
    rows = pq.read_table(prompts).to_pylist()
    if args.limit:
        rows = rows[: int(args.limit)]
    for extra in args.extra_prompts:
        rows += pq.read_table(require_file(resolve(workdir, extra), "more prompts", "materialize them first")).to_pylist()
    if not rows:
        raise StageError(f"{prompts} holds no conversations: add prompt sources to the prompts asset")
    target = resolve(workdir, args.target)
    tok = load_tokenizer(target)
    from ..compute_dtype import choice, host_device, line

    dtype_info = choice(args.dtype, host_device(args.device))
    args = args.model_copy(update={"dtype": dtype_info["dtype"]})
    reporter.log(line(dtype_info))

    first = Sampler("greedy" if args.temperature == 0 else "sampled", args.temperature, args.top_p, args.seed)
    extra = Sampler("sampled", args.sample_temperature, args.sample_top_p, args.sample_seed)
    convs = [_Conv(r, first if v == 0 else extra, v) for r in rows for v in range(args.responses_per_prompt)]
    total_turns = sum(sum(m["role"] == "user" for m in c.todo) for c in convs)
    reporter.log(f"regenerating {total_turns} assistant turns of {len(convs)} conversations ({len(rows)} prompts x "
                 f"{args.responses_per_prompt} replies) with {target.name} on {args.backend} (max_new_tokens="
                 f"{args.max_new_tokens}; first reply temperature {first.temperature}, top_p {first.top_p}"
                 + (f"; the others temperature {extra.temperature}, top_p {extra.top_p}"
                    if args.responses_per_prompt > 1 else "") + f"; batch={args.batch_size})")
    settings = Settings.of(args, max_model_len=args.max_prompt_tokens + args.max_new_tokens)
    with backend(settings, target, tok, out.parent, reporter) as complete, \
            reporter.progress("generate", total_turns, unit="turns") as prog:
        launch = getattr(complete, "launch", {})  # a server backend's launch settings
        t0 = time.monotonic()
        # the budget counts generation only (a server's start is not the machine's speed); greedy replies,
        # the kind serving measures, go first
        deadline = t0 + args.time_budget_s if args.time_budget_s else None
        turns_left, started = 0, False
        pending = [(c, p) for c in convs if (p := c.next_prompt()) is not None]
        while pending:
            nxt = []
            for kind in sorted({c.kind for c, _ in pending}, key=lambda k: k.name):  # a batch shares its sampling
                group = [(c, _prompt_ids(tok, p, args.max_prompt_tokens)) for c, p in pending if c.kind == kind]
                if deadline is not None and started and time.monotonic() >= deadline:  # nothing more starts
                    done = [None] * len(group)
                else:  # the first batch runs in any case: there is no time to go by before it
                    started = True
                    done = complete([ids for _, (ids, _) in group], [c.seed for c, _ in group], kind, prog, deadline)
                for (conv, (_, cut)), c in zip(group, done):
                    if c is None:  # not started within the time budget: the conversation ends before this turn
                        turns_left += 1 + sum(m["role"] == "user" for m in conv.todo)
                        conv.todo = []
                        continue
                    reply = Reply(c.prompt_ids, c.ids, c.text, c.capped, cut)
                    conv.replies.append(reply)
                    conv.out.append({"role": "assistant", "content": reply.text})
                    if reply.prompt_too_long:
                        conv.todo = []  # the history no longer fits the prompt budget: end it here
                    if (p := conv.next_prompt()) is not None:
                        nxt.append((conv, p))
            pending = nxt
    wall = time.monotonic() - t0
    left_out = [c for c in convs if not c.replies]
    if left_out:
        reporter.log(f"time budget ({args.time_budget_s:g} s of generation): {len(convs) - len(left_out)} of "
                     f"{len(convs)} conversations answered, {len(left_out)} left out ({turns_left} turns in all)")
        convs = [c for c in convs if c.replies]

    records, stats, bad = [], Counter(), []
    for c in convs:
        while c.out[-1]["role"] != "assistant":  # a system message after the last user turn: nothing answered it
            c.out.pop()
        last = c.replies[-1]
        ids, mask = training_sequence(tok, c.out, last.prompt_ids, last.ids, [r.capped for r in c.replies], c.id)
        generated = sum(len(r.ids) for r in c.replies)
        records.append({"id": c.id, "source": c.source, "kind": c.kind.name, "messages": c.out, "input_ids": ids,
                        "loss_mask": mask, "num_tokens": len(ids), "num_loss_tokens": sum(mask),
                        "generated_tokens": generated, "truncated_turns": sum(r.capped for r in c.replies)})
        k = c.kind.name
        stats[f"{k}_conversations"] += 1
        stats[f"{k}_generated_tokens"] += generated
        stats[f"{k}_loss_tokens"] += sum(mask)
        for r in c.replies:
            if not r.text.strip():
                stats["empty_replies"] += 1
                bad.append(r)
            elif degenerate(r.ids):
                stats["degenerate_replies"] += 1
                bad.append(r)
    replies = sum(len(c.replies) for c in convs)
    bad_share = len(bad) / max(replies, 1)
    if bad_share > args.max_bad_reply_share:
        examples = [repr(r.text[:60]) for r in bad[:3]]
        raise StageError(
            f"{stats['empty_replies']} of {replies} replies are empty and {stats['degenerate_replies']} more loop "
            f"(the same few tokens over and over), {bad_share:.0%} in all, above max_bad_reply_share "
            f"{args.max_bad_reply_share:.0%}; for example {', '.join(examples)}. A drafter trained on them learns "
            "little about real replies: check the target's chat template and its stop token, the prompts, or "
            "raise max_bad_reply_share if this is how the target answers")
    table = pa.Table.from_pylist(records, schema=SCHEMA)
    with atomic_file(out) as tmp:
        pq.write_table(table, tmp)
    version = sha256_file(out)[:32]
    gen_tokens = sum(r["generated_tokens"] for r in records)
    meta = {
        "path": str(out),
        "backend": args.backend,
        **launch,
        "conversations": len(records),
        "prompts": len(rows),
        "responses_per_prompt": args.responses_per_prompt,
        "assistant_turns": total_turns,
        **{f"{k}_{what}": stats[f"{k}_{what}"] for k in KINDS
           for what in ("conversations", "generated_tokens", "loss_tokens")},
        "conversations_by_source": dict(Counter(r["source"] for r in records)),
        "loss_tokens_by_source": dict(sum((Counter({r["source"]: r["num_loss_tokens"]}) for r in records), Counter())),
        "generated_tokens": gen_tokens,
        "tokens_per_s": round(gen_tokens / max(wall, 1e-9), 2),
        "wall_s": round(wall, 2),
        "length_capped_turns": sum(r["truncated_turns"] for r in records),
        "time_budget_s": args.time_budget_s,
        "conversations_left_out": len(left_out),  # by the time budget: the machine was slower than it allows
        "turns_left_out": turns_left,
        "empty_replies": stats["empty_replies"],
        "degenerate_replies": stats["degenerate_replies"],
        "bad_reply_share": round(bad_share, 4),
        "total_tokens": sum(r["num_tokens"] for r in records),
        "loss_tokens": sum(r["num_loss_tokens"] for r in records),
        **dtype_info,
        "sampling": {"temperature": first.temperature, "top_p": first.top_p, "max_new_tokens": args.max_new_tokens,
                     "seed": args.seed, "max_prompt_tokens": args.max_prompt_tokens,
                     **({"sample_temperature": extra.temperature, "sample_top_p": extra.top_p,
                         "sample_seed": extra.seed} if args.responses_per_prompt > 1 else {})},
    }
    reporter.materialize(metadata=meta, data_version=version)
    reporter.result({"path": str(out), "conversations": len(records), "data_version": version})
