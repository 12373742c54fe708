"""The worker stages on a GPU host, end to end, at a Llama-3.1-8B layer shape (hidden 4096, vocab 128256,
a 6-layer random-weight target to keep the files small): extract -> vocab -> train on 1 GPU and, when the
host has more, data-parallel on all of them -> export. Prints each stage's result JSON and wall time.

    python bench/gpu_stages.py --samples 120 --workdir /tmp/gpu-stages
"""

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


def stage(workdir: Path, name: str, args: dict) -> dict:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "eagle3_assets.worker", name, "--workdir", str(workdir), "--args", json.dumps(args)]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "EAGLE3_NO_BAR": "1", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stderr[-5000:]}")
    out = json.loads(next(ln for ln in reversed(done.stdout.strip().splitlines()) if ln.startswith("{")))
    print(json.dumps({"stage": name, "wall_s": round(time.perf_counter() - t0, 1),
                      **{k: v for k, v in out.items() if k not in ("acc", "loss")}}), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/gpu-stages")
    ap.add_argument("--samples", type=int, default=120)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    wd = Path(args.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    tdir = wd / "target"
    if not (tdir / "config.json").exists():
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=6, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                          architectures=["LlamaForCausalLM"])
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            LlamaForCausalLM(cfg).save_pretrained(tdir)
        torch.set_default_dtype(torch.float32)
    rng = random.Random(0)
    rows = []
    for i in range(args.samples):
        n = rng.randint(args.seq // 2, args.seq)
        rows.append({"id": f"s{i}", "input_ids": [rng.randrange(128000) for _ in range(n)],
                     "loss_mask": [int(j > n // 4) for j in range(n)]})
    pq.write_table(pa.Table.from_pylist(rows), wd / "conv.parquet")
    per = (args.samples + 1) // 2
    for shard in (0, 1):
        stage(wd, "extract", {"target": "target", "conversations": "conv.parquet", "out_dir": "hs", "shard": shard,
                              "samples_per_shard": per, "aux_layers": [1, 2, 4]})
    stage(wd, "vocab", {"target": "target", "conversations": "conv.parquet", "out": "vocab.safetensors"})
    train = {"target": "target", "shards": ["hs/shard-00000", "hs/shard-00001"], "vocab": "vocab.safetensors",
             "epochs": 1, "ttt_steps": 7, "row_tokens": 2048, "rows_per_batch": 4, "probe_batches": 2}
    stage(wd, "train", {**train, "out": "drafter-1gpu"})
    gpus = torch.cuda.device_count()
    if gpus > 1:
        stage(wd, "train", {**train, "out": f"drafter-{gpus}gpu", "num_processes": gpus})
    stage(wd, "export", {"target": "target", "drafter": "drafter-1gpu/model", "out": "exports"})


if __name__ == "__main__":
    main()
