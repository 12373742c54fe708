"""Hidden-state extraction throughput: our extractor vs the common naive design, same model, same data.

    python bench/extract_bench.py --shape llama-3.1-8b --tokens 400000      # on a GPU host
    python bench/extract_bench.py --shape smollm2 --tokens 20000            # anywhere

Random weights (throughput depends on shapes, not values). Designs measured, each over the same samples:
- forward:  our hooked forward alone, nothing copied or written (the ceiling for the rest);
- ours:     `extract_samples` as the `extract` stage runs it (gather, pinned copy, threaded write+sha256);
- naive:    HF forward with output_hidden_states=True (full model, lm_head included), then one torch.save
            of a dict per sample, as SpecForge's prepare_hidden_states and ModelOpt's HF dumper do.
Every part is fsynced by the writer threads (as the stage writes it); `--sync` adds an fsync of everything
written before the clock stops. `--storage fp8` writes shard format v2.
Prints one JSON object."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle3_assets.common.shard_format import default_aux_layers  # noqa: E402
from eagle3_assets.worker.hidden_states.extract import (  # noqa: E402
    HiddenStateCapture,
    Sample,
    extract_samples,
    make_batches,
    pad_batch,
)

SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True),
}


def build_model(shape: str, device: str, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa")
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval()


def make_samples(n_tokens: int, seq_len: int, vocab: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out, total, row = [], 0, 0
    while total < n_tokens:
        ln = rng.randint(seq_len // 2, seq_len)  # varied lengths, as real conversations are
        ids = [rng.randrange(vocab) for _ in range(ln)]
        out.append(Sample(row, f"s{row}", ids, [1] * ln))
        total += ln
        row += 1
    return out


def sync_dir(d: Path) -> None:
    for p in d.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def du(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def cuda_sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_forward(model, samples, aux, batch_tokens):
    cap = HiddenStateCapture(model, aux)
    dev = next(model.parameters()).device
    with torch.inference_mode():
        for batch in make_batches(samples, batch_tokens):
            cap(pad_batch(batch)[0].to(dev))
    cap.close()


def run_naive(model, samples, out: Path, batch_tokens):
    n = model.config.num_hidden_layers
    dev = next(model.parameters()).device
    with torch.inference_mode():
        for batch in make_batches(samples, batch_tokens):
            L = len(batch[0].input_ids)
            ids = torch.zeros((len(batch), L), dtype=torch.long)
            att = torch.zeros((len(batch), L), dtype=torch.long)
            for b, s in enumerate(batch):
                ids[b, : len(s.input_ids)] = torch.tensor(s.input_ids)
                att[b, : len(s.input_ids)] = 1
            hs = model(input_ids=ids.to(dev), attention_mask=att.to(dev), output_hidden_states=True).hidden_states
            for b, s in enumerate(batch):
                ln = len(s.input_ids)
                torch.save({
                    "input_ids": torch.tensor(s.input_ids),
                    "loss_mask": torch.tensor(s.loss_mask),
                    "hidden_state": hs[-1][b: b + 1, :ln].to("cpu", copy=True),
                    "aux_hidden_state": torch.cat([hs[2][b:b + 1, :ln], hs[n // 2][b:b + 1, :ln],
                                                   hs[n - 3][b:b + 1, :ln]], dim=-1).to("cpu", copy=True),
                }, out / f"data_{s.row}.ckpt")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=400_000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--part-bytes", type=int, default=1 << 30)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where files are written (default: a temp dir)")
    ap.add_argument("--designs", default="forward,ours,naive")
    ap.add_argument("--sync", action="store_true", help="fsync everything written before stopping the clock "
                    "(the stage's own parts are fsynced by its writer threads already)")
    ap.add_argument("--storage", default="native", choices=["native", "fp8"], help="ours: shard format v1 or v2")
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    model = build_model(args.shape, device, dtype)
    n = model.config.num_hidden_layers
    aux = default_aux_layers(n)
    samples = make_samples(args.tokens, args.seq_len, model.config.vocab_size)
    total = sum(len(s.input_ids) for s in samples)
    warm = make_samples(args.batch_tokens, args.seq_len, model.config.vocab_size, seed=1)
    root = Path(args.dir or tempfile.mkdtemp(prefix="extract-bench-"))
    report = {"shape": args.shape, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "dtype": "bfloat16", "samples": len(samples), "tokens": total, "seq_len_max": args.seq_len,
              "batch_tokens": args.batch_tokens, "aux_layers": aux, "torch": torch.__version__,
              "storage": args.storage, "fsync": bool(args.sync)}
    for design in args.designs.split(","):
        out = root / design
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        kw = dict(batch_tokens=args.batch_tokens, part_bytes=args.part_bytes, io_threads=args.io_threads,
                  storage=args.storage)
        if design == "forward":
            fn = lambda s: run_forward(model, s, aux, args.batch_tokens)  # noqa: E731
        elif design == "ours":
            fn = lambda s, out=out, kw=kw: extract_samples(model, s, out, aux, **kw)  # noqa: E731
        else:
            fn = lambda s, out=out: run_naive(model, s, out, args.batch_tokens)  # noqa: E731
        fn(warm)  # compile/warm-up kernels and allocator; not timed
        shutil.rmtree(out)
        out.mkdir()
        cuda_sync()
        t0 = time.perf_counter()
        fn(samples)
        cuda_sync()
        if args.sync:
            sync_dir(out)
        wall = time.perf_counter() - t0
        nbytes = du(out)
        report[design] = {"tokens_per_s": round(total / wall, 1), "wall_s": round(wall, 2),
                          "bytes_per_token": round(nbytes / total, 1) if nbytes else 0}
        if device == "cuda":
            report[design]["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            torch.cuda.reset_peak_memory_stats()
        shutil.rmtree(out, ignore_errors=True)
        print(json.dumps({design: report[design]}), file=sys.stderr, flush=True)
    if "ours" in report and "naive" in report:
        report["speedup_vs_naive"] = round(report["ours"]["tokens_per_s"] / report["naive"]["tokens_per_s"], 2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
