"""Drafter training throughput and peak GPU memory at a realistic target shape, random weights and
synthetic hidden states (throughput depends on shapes, not values).

    python bench/train_bench.py --shape llama-3.1-8b                 # on a GPU host
    python bench/train_bench.py --shape smollm2 --steps 3 --configs 1x256:3

Each config is ROWSxROW_TOKENS:TTT_STEPS; tokens per step = ROWS x ROW_TOKENS (packed: 2 samples a row).
It runs the same `ttt_loss` + AdamW step as the `train` stage, with bf16 autocast on GPU. Prints JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle3_assets.worker.drafter import DraftConfig, Eagle3Drafter, init_weights  # noqa: E402
from eagle3_assets.worker.target_head import TargetHead  # noqa: E402
from eagle3_assets.worker.train import autocast, ttt_loss  # noqa: E402

SHAPES = {
    "llama-3.1-8b": dict(hidden=4096, inter=14336, heads=32, kv=8, vocab=128256, draft_vocab=32000),
    "smollm2": dict(hidden=576, inter=1536, heads=9, kv=3, vocab=49152, draft_vocab=32000),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--configs", default="4x2048:7,4x2048:3,1x2048:7,1x2048:3")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps per config")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=None)
    args = ap.parse_args()
    s = dict(SHAPES[args.shape])
    if args.draft_vocab:
        s["draft_vocab"] = args.draft_vocab
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = DraftConfig(hidden_size=s["hidden"], intermediate_size=s["inter"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv"], head_dim=s["hidden"] // s["heads"], rms_norm_eps=1e-5,
                      rope_theta=500000.0, max_position_embeddings=8192, vocab_size=s["vocab"],
                      draft_vocab_size=s["draft_vocab"], target_hidden_size=s["hidden"], aux_layer_ids=[1, 15, 28])
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02
    head = TargetHead(embed, torch.ones(s["hidden"]), torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02, 1e-5)
    model = Eagle3Drafter(cfg, embed)
    init_weights(model)
    used = torch.sort(torch.randperm(s["vocab"], generator=g)[: s["draft_vocab"]]).values
    model.d2t.copy_(used - torch.arange(s["draft_vocab"]))
    model.t2d[used] = True
    model.to(device)
    head.to(device=device, dtype=dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    report = {"shape": args.shape, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "draft_params_trainable": sum(p.numel() for p in params), "runs": []}
    for spec in args.configs.split(","):
        rows_tokens, ttt = spec.split(":")
        rows, T = map(int, rows_tokens.split("x"))
        ttt = int(ttt)
        half = T // 2  # two documents per row, as packing makes them
        batch = {
            "input_ids": torch.randint(0, s["vocab"], (rows, T), generator=g),
            "loss_mask": torch.ones(rows, T, dtype=torch.bool),
            "aux": torch.randn(rows, T, 3 * s["hidden"], generator=g).to(dtype),
            "final": torch.randn(rows, T, s["hidden"], generator=g).to(dtype),
            "doc": torch.cat([torch.zeros(rows, half, dtype=torch.long), torch.ones(rows, T - half, dtype=torch.long)], 1),
            "pos": torch.cat([torch.arange(half), torch.arange(T - half)]).repeat(rows, 1),
        }
        batch = {k: v.to(device) for k, v in batch.items()}
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            with autocast(device):
                loss, *_ = ttt_loss(model, head, batch, ttt, 0.8, dtype)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        run = {"tokens_per_step": rows * T, "ttt_steps": ttt,
               "tokens_per_s": round(args.steps * rows * T / wall, 1), "step_s": round(wall / args.steps, 4)}
        if device == "cuda":
            run["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        report["runs"].append(run)
        print(json.dumps(run), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
