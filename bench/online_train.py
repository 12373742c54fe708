"""Online training (`hidden_states: online`) against the offline pipeline it replaces, in one run, on one GPU:
the real `extract` stage (one shard, fp8 storage: the default), the real `train` stage on that shard, then the
real `train` stage online from the same conversations (the target beside the drafter, nothing written).

    python bench/online_train.py --out bench/results/online_train_h200.json       # on a GPU host
    python bench/online_train.py --layers 2 --hidden 64 --steps 2 --warmup 1 ...   # (no GPU: a smoke test only)

Target: the Llama-3.1-8B layer shape (hidden 4096, MLP 14336, 32 heads / 8 KV heads, vocab 128256) with
random weights and --layers decoder layers (6 by default: bench/gpu_stages.py's choice, to keep the files
small; a 32-layer target's forward costs ~5x more per token). Draft vocab 32000, TTT 3, 8192 tokens per
optimizer step (1 x 8192), samples of uniform random length in [512, 4096]: the batch shape of
bench/results/train_h200_llama8b.json. Training tokens/s are timed as bench/train_bench.py times them (the
--steps steps after --warmup, wall clock between two GPU syncs, real tokens; the same child runs the stage);
extraction tokens/s is the extract stage's own figure (after the target is loaded, every part fsynced).
Serialized bound = 1 / (1/extract + 1/train): what extracting then training the same tokens gives; the goal is
online >= 0.9 x that. Bytes of hidden states written: the shard's bytes offline, the growth of the work
directory outside the drafter's run directory online (0 expected)."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from train_bench import make_vocab, sample_lengths  # noqa: E402


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "EAGLE3_NO_BAR": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def worker(workdir: Path, stage: str, args: dict, timeout: float) -> dict:
    """A stage as the host runs it; its metadata (the line the reporter writes on stderr)."""
    t0 = time.perf_counter()
    done = run([sys.executable, "-m", "eagle3_assets.worker", stage, "--workdir", str(workdir), "--args",
                json.dumps(args)], timeout)
    if done.returncode != 0:
        sys.exit(f"{stage} failed:\n{done.stderr[-5000:]}")
    meta = json.loads(next(x for x in done.stderr.splitlines() if x.startswith('{"metadata"')))["metadata"]
    meta["process_wall_s"] = round(time.perf_counter() - t0, 1)
    return meta


def timed_train(workdir: Path, args: dict, warmup: int, steps: int, timeout: float) -> dict:
    """bench/train_bench.py's child: the train stage in a process of its own, its steps timed."""
    spec = {"workdir": str(workdir), "args": args, "warmup": warmup, "steps": steps}
    done = run([sys.executable, str(ROOT / "bench/train_bench.py"), "--child", json.dumps(spec)], timeout)
    got = [x for x in done.stdout.splitlines() if x.startswith("BENCH_RESULT ")]
    if not got:
        return {"error": f"rc {done.returncode}: {done.stderr[-3000:]}"}
    return json.loads(got[-1].removeprefix("BENCH_RESULT "))


def du(d: Path, skip: Path | None = None) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and not (skip and p.is_relative_to(skip)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/online-train")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=30, help="timed optimizer steps per training run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--row-tokens", type=int, default=8192)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--target-batch-tokens", type=int, default=4096, help="online: padded tokens per target forward")
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--only", default="extract,offline,online")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3_assets.worker.training.trainer import PACK_WINDOW

    cuda = torch.cuda.is_available()
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    big = a.hidden == 4096
    vocab, draft = (128256, 32000) if big else (512, 128)
    t0 = time.perf_counter()
    tdir = wd / "target"
    if not (tdir / "config.json").exists():
        cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=14336 if big else 2 * a.hidden,
                          num_hidden_layers=a.layers, num_attention_heads=32 if big else 4,
                          num_key_value_heads=8 if big else 2, vocab_size=vocab, max_position_embeddings=8192,
                          rope_theta=500000.0, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda" if cuda else "cpu"):
            LlamaForCausalLM(cfg).save_pretrained(tdir)
        torch.set_default_dtype(torch.float32)
    make_vocab(wd / "vocab/vocab_mapping.safetensors", vocab, draft)
    # epoch 0's plan: warmup + steps timed, then the packing window's leftovers (as train_bench)
    lengths = sample_lengths([(1, a.row_tokens, a.ttt)], a.warmup, a.steps + PACK_WINDOW + 2, 512, 4096,
                             PACK_WINDOW if cuda else 1)
    r = random.Random(7)
    rows = [{"id": f"s{i}", "input_ids": [r.randrange(vocab) for _ in range(n)],
             "loss_mask": [0] * (n // 4) + [1] * (n - n // 4)} for i, n in enumerate(lengths)]
    (wd / "conversations").mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), wd / "conversations/conversations.parquet")
    report = {"bench": "online_train", "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "target": {"shape": "llama-3.1-8b layers" if big else "tiny",
                                                     "hidden": a.hidden, "layers": a.layers, "vocab": vocab,
                                                     "weights": "random bf16"},
              "draft_vocab": draft, "ttt_steps": a.ttt, "tokens_per_step": a.row_tokens, "samples": len(lengths),
              "tokens": sum(lengths), "sample_len": [512, 4096], "warmup_steps": a.warmup, "steps_timed": a.steps,
              "setup_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps({k: v for k, v in report.items()}), file=sys.stderr, flush=True)
    train = {"target": "target", "vocab": "vocab/vocab_mapping.safetensors", "epochs": 1, "ttt_steps": a.ttt,
             "row_tokens": a.row_tokens, "rows_per_batch": 1, "probe_batches": 1, "resume": False}
    only = a.only.split(",")
    if "extract" in only:
        meta = worker(wd, "extract", {"target": "target", "conversations": "conversations/conversations.parquet",
                                      "shard": 0, "samples_per_shard": len(lengths), "max_length": 4096,
                                      "batch_tokens": 16384, "storage": "fp8"}, a.timeout_s)
        report["extract"] = {k: meta[k] for k in ("tokens", "tokens_per_s", "wall_s", "bytes", "bytes_per_token",
                                                  "storage", "dtype", "process_wall_s")}
        print(json.dumps({"extract": report["extract"]}), file=sys.stderr, flush=True)
    if "offline" in only:
        report["offline_train"] = timed_train(wd, {**train, "shards": ["hidden_states/shard-00000"],
                                                   "out": "drafter/offline"}, a.warmup, a.steps, a.timeout_s)
        print(json.dumps({"offline_train": report["offline_train"]}), file=sys.stderr, flush=True)
    if "online" in only:
        before = du(wd, wd / "drafter/online")
        report["online_train"] = timed_train(wd, {**train, "hidden_states": "online", "max_length": 4096,
                                                  "conversations": "conversations/conversations.parquet",
                                                  "target_batch_tokens": a.target_batch_tokens,
                                                  "out": "drafter/online"}, a.warmup, a.steps, a.timeout_s)
        report["online_train"]["hidden_state_bytes_written_measured"] = du(wd, wd / "drafter/online") - before
        print(json.dumps({"online_train": report["online_train"]}), file=sys.stderr, flush=True)
    ext, off, on = (report.get(k, {}).get("tokens_per_s") for k in ("extract", "offline_train", "online_train"))
    if ext and off:
        bound = 1 / (1 / ext + 1 / off)
        report["serialized_bound_tokens_per_s"] = round(bound, 1)
        if on:
            report["online_over_bound"] = round(on / bound, 3)
            report["online_over_offline_train"] = round(on / off, 3)
    if "extract" in report:
        report["offline_hidden_state_bytes_written"] = report["extract"]["bytes"]
    print(json.dumps(report, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
