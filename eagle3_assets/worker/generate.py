"""Stage `generate`: the target regenerates every assistant turn of the training prompts, so the drafter
learns the target's own distribution. Backend `hf`: batched `generate` in this process."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.parquet as pq

from .chat import render, tokenize_conversation
from .errors import StageError
from .files import atomic_file, require_file, resolve, sha256_file
from .target import load_model, load_tokenizer

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


def run(workdir: str, args: dict, reporter) -> None:
    import torch

    prompts = require_file(resolve(workdir, args["prompts"]), "training prompts",
                           "materialize the prompts asset first")
    out = resolve(workdir, args["out"])
    rows = pq.read_table(prompts).to_pylist()
    if args.get("limit"):
        rows = rows[: int(args["limit"])]
    if not rows:
        raise StageError(f"{prompts} holds no conversations: add prompt sources to the prompts asset")
    max_new = int(args.get("max_new_tokens", 256))
    temperature = float(args.get("temperature", 0.0))
    top_p = float(args.get("top_p", 1.0))
    batch_size = int(args.get("batch_size", 16))
    max_prompt_tokens = int(args.get("max_prompt_tokens", 2048))
    torch.manual_seed(int(args.get("seed", 0)))

    target = resolve(workdir, args["target"])
    model = load_model(target, args.get("dtype", "bfloat16"), args.get("device", "auto"))
    tok = load_tokenizer(target)
    tok.padding_side = "left"  # decoder-only batched generation pads on the left
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tok.eos_token_id])

    convs = [_Conv(r) for r in rows]
    total_turns = sum(sum(m["role"] == "user" for m in c.todo) for c in convs)
    reporter.log(f"regenerating {total_turns} assistant turns of {len(convs)} conversations with {target.name} "
                 f"(max_new_tokens={max_new}, temperature={temperature}, top_p={top_p}, batch={batch_size})")
    t0 = time.monotonic()
    gen_tokens = 0
    with reporter.progress("generate", total_turns, unit="turns") as prog:
        pending = [(c, p) for c in convs if (p := c.next_prompt()) is not None]
        while pending:
            texts = [render(tok, p, add_generation_prompt=True) for _, p in pending]
            order = sorted(range(len(pending)), key=lambda i: len(texts[i]))  # similar lengths, less padding
            nxt = []
            for s in range(0, len(order), batch_size):
                idx = order[s: s + batch_size]
                enc = tok([texts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False)
                too_long = enc["input_ids"].shape[1] > max_prompt_tokens
                enc = {k: v[:, -max_prompt_tokens:].to(model.device) for k, v in enc.items()}
                with torch.inference_mode():
                    gen = model.generate(**enc, max_new_tokens=max_new, do_sample=temperature > 0,
                                         temperature=temperature if temperature > 0 else None,
                                         top_p=top_p if temperature > 0 else None,
                                         pad_token_id=tok.pad_token_id)
                new = gen[:, enc["input_ids"].shape[1]:].tolist()
                batch_tokens = 0
                for i, ids in zip(idx, new):
                    conv = pending[i][0]
                    n = next((k for k, t in enumerate(ids) if t in eos_ids), None)
                    if n is None:
                        conv.truncated += 1
                        n = len(ids)
                    conv.out.append({"role": "assistant", "content": tok.decode(ids[:n], skip_special_tokens=True).strip()})
                    conv.generated += n
                    batch_tokens += n
                    if too_long:
                        conv.todo = []  # the history no longer fits the prompt budget: end it here
                    if (p := conv.next_prompt()) is not None:
                        nxt.append((conv, p))
                gen_tokens += batch_tokens
                prog.update(len(idx), tokens=batch_tokens)
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
        "backend": "hf",
        "conversations": len(records),
        "assistant_turns": total_turns,
        "generated_tokens": gen_tokens,
        "tokens_per_s": round(gen_tokens / max(wall, 1e-9), 2),
        "wall_s": round(wall, 2),
        "length_capped_turns": sum(c.truncated for c in convs),
        "total_tokens": sum(r["num_tokens"] for r in records),
        "loss_tokens": sum(r["num_loss_tokens"] for r in records),
        "sampling": {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new,
                     "seed": int(args.get("seed", 0)), "max_prompt_tokens": max_prompt_tokens},
    }
    reporter.materialize(metadata=meta, data_version=version)
    reporter.result({"path": str(out), "conversations": len(records), "data_version": version})
