"""Stage `generate`: the target regenerates every assistant turn of the training prompts, so the drafter
learns the target's own distribution. Backends: `hf`, batched `generate` in this process; each engine of
worker/engines/ (`vllm`, `sglang`), the target served on the host and asked through its API, for large sets.

Each prompt gets a greedy reply (the kind serving measures) and, with `responses_per_prompt` > 1, sampled
ones: more of the target's own text from the same prompts. A reply is kept as the target produced it: the
prompt ids it was fed, then its own tokens, its end-of-turn token only where it emitted one (a reply cut at
max_new_tokens ends there, with no marker the target never wrote for the drafter to learn)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from ...common import engines
from ..errors import StageError
from ..files import atomic_file, require_file, resolve, sha256_file
from ..target.chat import render, training_sequence
from ..target.model import load_model, load_tokenizer

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


@dataclass(frozen=True)
class Kind:
    """How one kind of reply is drawn."""
    name: str
    temperature: float
    top_p: float
    seed: int


@dataclass
class Reply:
    prompt_ids: list[int]  # exactly what the target was fed
    ids: list[int]  # what it produced, its end-of-turn token included when it emitted one
    text: str  # decoded as produced (special tokens dropped, nothing stripped)
    capped: bool  # stopped by max_new_tokens, not by the model
    prompt_too_long: bool  # the history was cut to max_prompt_tokens


class _Conv:
    def __init__(self, row: dict, kind: Kind, variant: int):
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
        """Each sampled variant its own seed: the same replies whatever the batches."""
        return self.kind.seed + 1_000_003 * self.variant


def _prompt_ids(tok, messages: list[dict], max_prompt_tokens: int) -> tuple[list[int], bool]:
    ids = tok(render(tok, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    return ids[-max_prompt_tokens:], len(ids) > max_prompt_tokens


def eos_ids(tok, generation_config=None) -> set[int]:
    eos = getattr(generation_config, "eos_token_id", None)
    eos = eos if eos is not None else tok.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


@contextmanager
def hf_backend(workdir: str, args: GenerateArgs, target, tok, reporter) -> Iterator:
    """Batched `generate` in this process, batches of similar lengths (less padding)."""
    import torch

    model = load_model(target, args.dtype, args.device)
    tok.padding_side = "left"  # decoder-only batched generation pads on the left
    stops = eos_ids(tok, model.generation_config)

    def complete(prompts: list[list[dict]], seeds: list[int], kind: Kind, prog) -> list[Reply]:
        encoded = [_prompt_ids(tok, p, args.max_prompt_tokens) for p in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(encoded[i][0]))
        replies: list[Reply | None] = [None] * len(prompts)
        sample = kind.temperature > 0
        for start in range(0, len(order), args.batch_size):
            idx = order[start: start + args.batch_size]
            width = max(len(encoded[i][0]) for i in idx)
            pad = tok.pad_token_id if tok.pad_token_id is not None else 0
            ids = torch.tensor([[pad] * (width - len(encoded[i][0])) + encoded[i][0] for i in idx], device=model.device)
            mask = torch.tensor([[0] * (width - len(encoded[i][0])) + [1] * len(encoded[i][0]) for i in idx],
                                device=model.device)
            if sample:
                torch.manual_seed(seeds[idx[0]])  # a batch shares one generator: seeded by its first prompt's
            with torch.inference_mode():
                gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                                     do_sample=sample, temperature=kind.temperature if sample else None,
                                     top_p=kind.top_p if sample else None, pad_token_id=tok.pad_token_id)
            batch_tokens = 0
            for i, new in zip(idx, gen[:, width:].tolist()):
                n = next((k for k, t in enumerate(new) if t in stops), None)
                own = new[: n + 1] if n is not None else new
                replies[i] = Reply(encoded[i][0], own, tok.decode(own, skip_special_tokens=True), n is None,
                                   encoded[i][1])
                batch_tokens += len(own)
            prog.update(len(idx), tokens=batch_tokens)
        return replies

    yield complete


def server_backend(engine_name: str):
    """The target served by the engine on the host (the same launch code as serve_bench, without a drafter),
    replies requested `batch_size` at a time through its OpenAI-compatible API: how large sets are
    regenerated. Every request carries its own seed; the server's prefix cache shares a prompt's prefill
    between its replies."""

    @contextmanager
    def backend(workdir: str, args: GenerateArgs, target, tok, reporter) -> Iterator:
        from ..engines import load
        from ..engines.server import EngineServer, check_support, free_port

        engine = engines.get(engine_name)
        python = args.engine_python or sys.executable
        check_support(engine, python, target)
        argv = engine.server_command(python, str(target), free_port(), drafter=None, k=0,
                                     dtype=args.dtype, max_model_len=args.max_prompt_tokens + args.max_new_tokens,
                                     seed=args.seed, extra=list(args.extra_args or []))
        env = {**engine.SERVER_ENV, **{str(k): str(v) for k, v in (args.env or {}).items()}}
        log = resolve(workdir, args.out).parent / f"server-{engine_name}.log"
        stops = eos_ids(tok)
        with EngineServer(f"{engine_name} (generation)", argv, int(argv[argv.index("--port") + 1]), log, env=env,
                          health=engine.HEALTH) as server:
            reporter.log(f"starting {engine_name} for generation: {' '.join(argv[1:])}")
            ready = server.wait_ready(float(args.ready_timeout_s), reporter)
            reporter.log(f"{engine_name} ready after {ready:.0f} s")

            def complete(prompts: list[list[dict]], seeds: list[int], kind: Kind, prog) -> list[Reply]:
                encoded = [_prompt_ids(tok, p, args.max_prompt_tokens) for p in prompts]
                reqs = [load.Request(str(i), ids) for i, (ids, _) in enumerate(encoded)]
                sampling = [{"temperature": kind.temperature, "top_p": kind.top_p, "seed": seed,
                             **engine.GENERATION_FIELDS} for seed in seeds]
                done = load.generate(server.base_url, "target", reqs, args.max_new_tokens, args.batch_size, sampling,
                                     on_done=lambda c: prog.update(1, tokens=len(c.token_ids or ()) or 1))
                bad = [c for c in done if c.error]
                if bad:
                    raise StageError(f"{len(bad)} generation requests to {engine_name} failed, first: {bad[0].error}"
                                     + (f"\n{why}" if (why := server.died()) else ""))
                return [_server_reply(c, e, tok, stops) for c, e in zip(done, encoded)]

            yield complete

    return backend


def _server_reply(c, encoded: tuple[list[int], bool], tok, stops: set[int]) -> Reply:
    """An engine's completion as ids: its own token ids where it returns them (vLLM: `return_token_ids`), else
    the text tokenized again (SGLang's completions carry none), with the end-of-turn token it stopped on."""
    stopped = c.finish_reason == "stop"
    ids = list(c.token_ids) if c.token_ids is not None else tok(c.text, add_special_tokens=False)["input_ids"]
    if stopped and not (ids and ids[-1] in stops):
        ids.append(c.matched_stop if isinstance(c.matched_stop, int) else min(stops))
    return Reply(encoded[0], ids, c.text, not stopped, encoded[1])


BACKENDS = {"hf": hf_backend, **{name: server_backend(name) for name in engines.NAMES}}


def degenerate(ids: list[int], n: int = 4, min_len: int = 32, min_distinct: float = 0.25) -> bool:
    """A reply that loops: at least `min_len` tokens whose n-grams are mostly repeats (fewer than
    `min_distinct` of them distinct). Looping replies are still the target's text; many of them say the
    prompts or the generation settings do not suit this target."""
    if len(ids) < min_len:
        return False
    grams = [tuple(ids[i: i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) < min_distinct


def run(workdir: str, args: GenerateArgs, reporter) -> None:
    prompts = require_file(resolve(workdir, args.prompts), "training prompts",
                           "materialize the prompts asset first")
    out = resolve(workdir, args.out)
    rows = pq.read_table(prompts).to_pylist()
    if args.limit:
        rows = rows[: int(args.limit)]
    if not rows:
        raise StageError(f"{prompts} holds no conversations: add prompt sources to the prompts asset")
    target = resolve(workdir, args.target)
    tok = load_tokenizer(target)
    from ..compute_dtype import choice, host_device, line

    dtype_info = choice(args.dtype, host_device(args.device))
    args = args.model_copy(update={"dtype": dtype_info["dtype"]})
    reporter.log(line(dtype_info))

    first = Kind("greedy" if args.temperature == 0 else "sampled", args.temperature, args.top_p, args.seed)
    extra = Kind("sampled", args.sample_temperature, args.sample_top_p, args.sample_seed)
    convs = [_Conv(r, first if v == 0 else extra, v) for r in rows for v in range(args.responses_per_prompt)]
    total_turns = sum(sum(m["role"] == "user" for m in c.todo) for c in convs)
    reporter.log(f"regenerating {total_turns} assistant turns of {len(convs)} conversations ({len(rows)} prompts x "
                 f"{args.responses_per_prompt} replies) with {target.name} on {args.backend} (max_new_tokens="
                 f"{args.max_new_tokens}; first reply temperature {first.temperature}, top_p {first.top_p}"
                 + (f"; the others temperature {extra.temperature}, top_p {extra.top_p}"
                    if args.responses_per_prompt > 1 else "") + f"; batch={args.batch_size})")
    with BACKENDS[args.backend](workdir, args, target, tok, reporter) as complete, \
            reporter.progress("generate", total_turns, unit="turns") as prog:
        t0 = time.monotonic()
        pending = [(c, p) for c in convs if (p := c.next_prompt()) is not None]
        while pending:
            nxt = []
            for kind in sorted({c.kind for c, _ in pending}, key=lambda k: k.name):  # a batch shares its sampling
                group = [(c, p) for c, p in pending if c.kind == kind]
                for (conv, _), reply in zip(group, complete([p for _, p in group], [c.seed for c, _ in group],
                                                            kind, prog)):
                    conv.replies.append(reply)
                    conv.out.append({"role": "assistant", "content": reply.text})
                    if reply.prompt_too_long:
                        conv.todo = []  # the history no longer fits the prompt budget: end it here
                    if (p := conv.next_prompt()) is not None:
                        nxt.append((conv, p))
            pending = nxt
    wall = time.monotonic() - t0

    records, stats, bad = [], Counter(), []
    for c in convs:
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
        "conversations": len(records),
        "prompts": len(rows),
        "responses_per_prompt": args.responses_per_prompt,
        "assistant_turns": total_turns,
        **{f"{k}_{what}": stats[f"{k}_{what}"] for k in KINDS
           for what in ("conversations", "generated_tokens", "loss_tokens")},
        "generated_tokens": gen_tokens,
        "tokens_per_s": round(gen_tokens / max(wall, 1e-9), 2),
        "wall_s": round(wall, 2),
        "length_capped_turns": sum(r["truncated_turns"] for r in records),
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
