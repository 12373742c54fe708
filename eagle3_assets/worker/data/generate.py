"""Stage `generate`: the target regenerates every assistant turn of the training prompts, so the drafter
learns the target's own distribution. Backends: `hf`, batched `generate` in this process; each engine of
worker/engines/ (`vllm`, `sglang`), the target served on the host and asked through its API, for large sets."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from ...common import engines
from ..errors import StageError
from ..files import atomic_file, require_file, resolve, sha256_file
from ..target.chat import render, tokenize_conversation
from ..target.model import load_model, load_tokenizer

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.generate import GenerateArgs

SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    ("num_loss_tokens", pa.int32()),
    ("generated_tokens", pa.int32()),
    ("truncated_turns", pa.int32()),
])


class _Conv:
    def __init__(self, row: dict):
        self.id, self.source = row["id"], row["source"]
        # Original assistant turns are dropped: every user turn gets the target's own reply.
        self.todo = [m for m in row["messages"] if m["role"] in ("system", "user")]
        self.out: list[dict] = []
        self.generated = 0
        self.truncated = 0

    def next_prompt(self) -> list[dict] | None:
        while self.todo:
            m = self.todo.pop(0)
            self.out.append(m)
            if m["role"] == "user":
                return self.out
        return None


@dataclass
class Sampling:
    max_new: int
    temperature: float
    top_p: float
    seed: int
    batch_size: int
    max_prompt_tokens: int


@dataclass
class Reply:
    text: str
    tokens: int
    capped: bool  # stopped by max_new_tokens, not by the model
    prompt_too_long: bool  # the history was cut to max_prompt_tokens


def _prompt_ids(tok, messages: list[dict], s: Sampling) -> tuple[list[int], bool]:
    ids = tok(render(tok, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    return ids[-s.max_prompt_tokens:], len(ids) > s.max_prompt_tokens


@contextmanager
def hf_backend(workdir: str, args: GenerateArgs, target, tok, s: Sampling, reporter) -> Iterator:
    """Batched `generate` in this process, batches of similar lengths (less padding)."""
    import torch

    torch.manual_seed(s.seed)
    model = load_model(target, args.dtype, args.device)
    tok.padding_side = "left"  # decoder-only batched generation pads on the left
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tok.eos_token_id])

    def complete(prompts: list[list[dict]], prog) -> list[Reply]:
        encoded = [_prompt_ids(tok, p, s) for p in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(encoded[i][0]))
        replies: list[Reply | None] = [None] * len(prompts)
        for start in range(0, len(order), s.batch_size):
            idx = order[start: start + s.batch_size]
            width = max(len(encoded[i][0]) for i in idx)
            pad = tok.pad_token_id if tok.pad_token_id is not None else 0
            ids = torch.tensor([[pad] * (width - len(encoded[i][0])) + encoded[i][0] for i in idx], device=model.device)
            mask = torch.tensor([[0] * (width - len(encoded[i][0])) + [1] * len(encoded[i][0]) for i in idx],
                                device=model.device)
            with torch.inference_mode():
                gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=s.max_new,
                                     do_sample=s.temperature > 0, temperature=s.temperature if s.temperature > 0 else None,
                                     top_p=s.top_p if s.temperature > 0 else None, pad_token_id=tok.pad_token_id)
            batch_tokens = 0
            for i, new in zip(idx, gen[:, width:].tolist()):
                n = next((k for k, t in enumerate(new) if t in eos_ids), None)
                replies[i] = Reply(tok.decode(new[: n if n is not None else len(new)], skip_special_tokens=True).strip(),
                                   n if n is not None else len(new), n is None, encoded[i][1])
                batch_tokens += replies[i].tokens
            prog.update(len(idx), tokens=batch_tokens)
        return replies

    yield complete


def server_backend(engine_name: str):
    """The target served by the engine on the host (the same launch code as serve_bench, without a drafter),
    replies requested `batch_size` at a time through its OpenAI-compatible API: how large sets are
    regenerated."""

    @contextmanager
    def backend(workdir: str, args: GenerateArgs, target, tok, s: Sampling, reporter) -> Iterator:
        from ..engines import load
        from ..engines.server import EngineServer, check_support, free_port

        engine = engines.get(engine_name)
        python = args.engine_python or sys.executable
        check_support(engine, python, target)
        argv = engine.server_command(python, str(target), free_port(), drafter=None, k=0,
                                     dtype=args.dtype, max_model_len=s.max_prompt_tokens + s.max_new,
                                     seed=s.seed, extra=list(args.extra_args or []))
        env = {**engine.SERVER_ENV, **{str(k): str(v) for k, v in (args.env or {}).items()}}
        log = resolve(workdir, args.out).parent / f"server-{engine_name}.log"
        with EngineServer(f"{engine_name} (generation)", argv, int(argv[argv.index("--port") + 1]), log, env=env,
                          health=engine.HEALTH) as server:
            reporter.log(f"starting {engine_name} for generation: {' '.join(argv[1:])}")
            ready = server.wait_ready(float(args.ready_timeout_s), reporter)
            reporter.log(f"{engine_name} ready after {ready:.0f} s")

            def complete(prompts: list[list[dict]], prog) -> list[Reply]:
                encoded = [_prompt_ids(tok, p, s) for p in prompts]
                reqs = [load.Request(str(i), ids) for i, (ids, _) in enumerate(encoded)]
                sampling = {"temperature": s.temperature, "top_p": s.top_p, "seed": s.seed}
                responses, _ = load.drive(server.base_url, "target", reqs, s.max_new, s.batch_size,
                                          on_done=lambda r: prog.update(1, tokens=r.output_tokens), sampling=sampling)
                bad = [r for r in responses if r.error]
                if bad:
                    raise StageError(f"{len(bad)} generation requests to {engine_name} failed, first: {bad[0].error}"
                                     + (f"\n{why}" if (why := server.died()) else ""))
                return [Reply(r.text.strip(), r.output_tokens, r.output_tokens >= s.max_new, e[1])
                        for r, e in zip(responses, encoded)]

            yield complete

    return backend


BACKENDS = {"hf": hf_backend, **{name: server_backend(name) for name in engines.NAMES}}


def run(workdir: str, args: GenerateArgs, reporter) -> None:
    prompts = require_file(resolve(workdir, args.prompts), "training prompts",
                           "materialize the prompts asset first")
    out = resolve(workdir, args.out)
    rows = pq.read_table(prompts).to_pylist()
    if args.limit:
        rows = rows[: int(args.limit)]
    if not rows:
        raise StageError(f"{prompts} holds no conversations: add prompt sources to the prompts asset")
    backend = args.backend
    if backend not in BACKENDS:
        raise StageError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    s = Sampling(max_new=int(args.max_new_tokens), temperature=float(args.temperature),
                 top_p=float(args.top_p), seed=int(args.seed),
                 batch_size=int(args.batch_size), max_prompt_tokens=int(args.max_prompt_tokens))
    max_new, temperature, top_p, max_prompt_tokens = s.max_new, s.temperature, s.top_p, s.max_prompt_tokens
    target = resolve(workdir, args.target)
    tok = load_tokenizer(target)
    from ..compute_dtype import choice, host_device, line

    dtype_info = choice(args.dtype, host_device(args.device))
    args = args.model_copy(update={"dtype": dtype_info["dtype"]})
    reporter.log(line(dtype_info))

    convs = [_Conv(r) for r in rows]
    total_turns = sum(sum(m["role"] == "user" for m in c.todo) for c in convs)
    reporter.log(f"regenerating {total_turns} assistant turns of {len(convs)} conversations with {target.name} "
                 f"on {backend} (max_new_tokens={max_new}, temperature={temperature}, top_p={top_p}, "
                 f"batch={s.batch_size})")
    gen_tokens = 0
    with BACKENDS[backend](workdir, args, target, tok, s, reporter) as complete, \
            reporter.progress("generate", total_turns, unit="turns") as prog:
        t0 = time.monotonic()
        pending = [(c, p) for c in convs if (p := c.next_prompt()) is not None]
        while pending:
            nxt = []
            for (conv, _), reply in zip(pending, complete([p for _, p in pending], prog)):
                conv.truncated += reply.capped
                conv.out.append({"role": "assistant", "content": reply.text})
                conv.generated += reply.tokens
                gen_tokens += reply.tokens
                if reply.prompt_too_long:
                    conv.todo = []  # the history no longer fits the prompt budget: end it here
                if (p := conv.next_prompt()) is not None:
                    nxt.append((conv, p))
            pending = nxt
    wall = time.monotonic() - t0

    records = []
    for c in convs:
        ids, mask = tokenize_conversation(tok, c.out, c.id)
        records.append({"id": c.id, "source": c.source, "messages": c.out, "input_ids": ids, "loss_mask": mask,
                        "num_tokens": len(ids), "num_loss_tokens": sum(mask), "generated_tokens": c.generated,
                        "truncated_turns": c.truncated})
    table = pa.Table.from_pylist(records, schema=SCHEMA)
    with atomic_file(out) as tmp:
        pq.write_table(table, tmp)
    version = sha256_file(out)[:32]
    meta = {
        "path": str(out),
        "backend": backend,
        "conversations": len(records),
        "assistant_turns": total_turns,
        "generated_tokens": gen_tokens,
        "tokens_per_s": round(gen_tokens / max(wall, 1e-9), 2),
        "wall_s": round(wall, 2),
        "length_capped_turns": sum(c.truncated for c in convs),
        "total_tokens": sum(r["num_tokens"] for r in records),
        "loss_tokens": sum(r["num_loss_tokens"] for r in records),
        **dtype_info,
        "sampling": {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new,
                     "seed": int(args.seed), "max_prompt_tokens": max_prompt_tokens},
    }
    reporter.materialize(metadata=meta, data_version=version)
    reporter.result({"path": str(out), "conversations": len(records), "data_version": version})
