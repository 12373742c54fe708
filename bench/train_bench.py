"""Throughput and peak GPU memory of the real `train` stage, run as the asset runs it: hidden-state shards
on disk in our format, a target directory, `run_stage("train", ...)` as the worker runs it (arguments
validated, every default filled in).

    python bench/train_bench.py --shape llama-3.1-8b --configs 1x8192:3,1x8192:7        # on a GPU host
    python bench/train_bench.py --storage fp8,native ...     # from fp8 shards (the default) and native ones
    python bench/train_bench.py --shape tiny --configs 1x256:2 --steps 3 --warmup 1     # CPU smoke test

Each config is ROWSxROW_TOKENS:TTT_STEPS (rows_per_batch x row_tokens = tokens per optimizer step) and runs
in a fresh process. Data: samples of uniform random length in [--min-len, --max-len] (speculators' bench:
512..4096) with random hidden states; the target is a directory of the shape's config with random
embedding, final norm and lm_head (all the stage reads of it). Timed: the --steps steps after --warmup
(compile and autotuning happen in those), wall clock between two GPU syncs; tokens = the real (non-padding)
tokens of the timed steps, as speculators' bench counts them. The one epoch has PACK_WINDOW + 2 steps more,
so that its last, part-filled rows (the packing window's leftovers) are not among the timed ones. The
stage's own end-to-end figures (`stage_tokens_per_s`, `stage_wall_s`, setup included) come along. Prints
one JSON line per config and the report; --out writes the report. --check compares the GPU path with the
dense reference path on the GPU (values and gradients)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "llama-3.1-8b": dict(hidden=4096, inter=14336, heads=32, kv=8, layers=32, vocab=128256, draft_vocab=32000),
    "smollm2": dict(hidden=576, inter=1536, heads=9, kv=3, layers=30, vocab=49152, draft_vocab=32000),
    "tiny": dict(hidden=64, inter=128, heads=4, kv=2, layers=8, vocab=512, draft_vocab=128),
}


def make_target(d: Path, s: dict, device: str) -> None:
    """A Llama config of the shape, and the only tensors the train stage reads: embed, final norm, lm_head."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    d.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["inter"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv"], num_hidden_layers=s["layers"], vocab_size=s["vocab"],
                      rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
                      rope_theta=500000.0)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(str(d))
    g = torch.Generator(device).manual_seed(0)
    V, H = s["vocab"], s["hidden"]
    save_file({"model.embed_tokens.weight": (torch.randn(V, H, generator=g, device=device) * 0.02).bfloat16().cpu(),
               "lm_head.weight": (torch.randn(V, H, generator=g, device=device) * 0.02).bfloat16().cpu(),
               "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}, str(d / "model.safetensors"))


def make_vocab(path: Path, vocab: int, draft: int) -> None:
    import torch
    from safetensors.torch import save_file

    used = torch.sort(torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:draft]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"d2t": used - torch.arange(draft), "t2d": t2d}, str(path))


def make_shard(out: Path, s: dict, lengths: list[int], device: str, storage: str = "fp8",
               part_tokens: int = 1 << 16) -> None:
    """One shard of random bf16 hidden states in the extract stage's format (its writer and publisher), stored
    as `storage` says: fp8 (format v2, the extract stage's default) or native bf16 (v1)."""
    import torch

    from eagle3_assets.worker.hidden_states.extract import publish_shard
    from eagle3_assets.worker.shards.parts import quantize_fp8, write_part

    H, tmp = s["hidden"], out.with_name(f".tmp-{out.name}")
    tmp.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device).manual_seed(1)
    gen = torch.Generator().manual_seed(2)
    files, index = [], []
    parts, cur, used = [], [], 0
    for i, ln in enumerate(lengths):  # samples to parts of about part_tokens
        if cur and used + ln > part_tokens:
            parts.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += ln
    parts.append(cur)
    for p, ids in enumerate(parts):
        t = sum(lengths[i] for i in ids)
        name = f"part-{p:04d}.safetensors"
        mask = torch.ones(t, dtype=torch.uint8)
        off = 0
        for i in ids:
            mask[off: off + lengths[i] // 4] = 0  # a prompt: no loss there
            index.append({"row": i, "id": f"s{i}", "part": name, "offset": off, "length": lengths[i],
                          "loss_tokens": lengths[i] - lengths[i] // 4})
            off += lengths[i]
        tensors = {"input_ids": torch.randint(0, s["vocab"], (t,), generator=gen), "loss_mask": mask}
        for key, layers in (("aux", 3), ("final", 1)):
            x = torch.randn(t, layers * H, generator=g, device=device).bfloat16()
            if storage == "fp8":
                x, tensors[f"{key}_scale"] = (v.cpu() for v in quantize_fp8(x, layers))
            tensors[key] = x.cpu()
        nbytes, digest = write_part(tmp / name, tensors)
        files.append({"name": name, "bytes": nbytes, "sha256": digest, "tokens": t})
    publish_shard(tmp, out, files, index, {"shard": 0, "target": "random", "hidden_size": H,
                                           "num_layers": s["layers"], "aux_layer_ids": [1, s["layers"] // 2 - 1,
                                                                                         s["layers"] - 4],
                                           "backend": "synthetic", "storage": storage, "dtype": "bfloat16"})


def sample_lengths(configs, warmup: int, steps: int, lo: int, hi: int, window: int) -> list[int]:
    """Just enough samples that epoch 0's plan has warmup + steps + 1 steps for every config."""
    import random

    from eagle3_assets.worker.training.data import plan_batches

    n = 8
    while True:
        r = random.Random(99)
        lengths = [r.randint(lo, hi) for _ in range(n)]
        if all(len(plan_batches(lengths, 0, 0, T, rows, window)) >= warmup + steps + 1 for rows, T, _ in configs):
            return lengths
        n = int(n * 1.2) + 1


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    out = []
    for spec in text.split(","):
        geometry, ttt = spec.split(":")
        rows, T = map(int, geometry.split("x"))
        out.append((rows, T, int(ttt)))
    return out


# ---- --check: the GPU path against the dense reference path, on the GPU, same weights and batch
def check(shape: str, T: int, ttt: int) -> dict:
    """Loss, per-step figures and gradients of the GPU path (compiled flex chain attention, compiled layer
    pieces and step loss) against the CPU path's dense eager code run on the GPU (EAGLE3_TRAIN_EAGER=1), in
    float32 and in bf16 autocast. Two rows of several documents and padding."""
    import torch

    from eagle3_assets.worker.target.head import TargetHead
    from eagle3_assets.worker.training.drafter import DraftConfig, Eagle3Drafter, init_weights
    from eagle3_assets.worker.training.evaluate import autocast
    from eagle3_assets.worker.training.ttt_loss import ttt_loss

    s, dev = SHAPES[shape], "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test only
    c = DraftConfig(hidden_size=s["hidden"], intermediate_size=s["inter"], num_attention_heads=s["heads"],
                    num_key_value_heads=s["kv"], head_dim=s["hidden"] // s["heads"], rms_norm_eps=1e-5,
                    rope_theta=500000.0, max_position_embeddings=8192, vocab_size=s["vocab"],
                    draft_vocab_size=s["draft_vocab"], target_hidden_size=s["hidden"], aux_layer_ids=[1, 15, 28])
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02
    head = TargetHead(embed, torch.ones(s["hidden"]), torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02, 1e-5)
    model = Eagle3Drafter(c, embed)
    init_weights(model)
    used = torch.sort(torch.randperm(s["vocab"], generator=g)[: s["draft_vocab"]]).values
    model.d2t.copy_(used - torch.arange(s["draft_vocab"]))
    model.t2d[used] = True
    model.to(dev)
    head.to(dev)
    head.restrict(used)
    cuts = [0, T // 5, T // 2, T - T // 8]  # row 0: three documents, then padding; row 1: two documents
    doc = torch.full((2, T), -1, dtype=torch.long)
    pos = torch.zeros(2, T, dtype=torch.long)
    for d, (a, b) in enumerate(zip(cuts, cuts[1:])):
        doc[0, a:b], pos[0, a:b] = d, torch.arange(b - a)
    doc[1, : T // 3], pos[1, : T // 3] = 0, torch.arange(T // 3)
    doc[1, T // 3:], pos[1, T // 3:] = 1, torch.arange(T - T // 3)
    batch = {"input_ids": torch.randint(0, s["vocab"], (2, T), generator=g), "doc": doc, "pos": pos,
             "loss_mask": doc >= 0, "aux": torch.randn(2, T, 3 * s["hidden"], generator=g),
             "final": torch.randn(2, T, s["hidden"], generator=g),
             "t_draft": torch.randint(0, s["draft_vocab"], (2, T), generator=g)}
    batch = {k: v.to(dev) for k, v in batch.items()}
    params = [p for p in model.parameters() if p.requires_grad]
    out = {"check": "gpu path vs dense reference", "shape": shape, "T": T, "ttt_steps": ttt}

    def run(bf16: bool, eager: bool):
        os.environ["EAGLE3_TRAIN_EAGER"] = "1" if eager else "0"
        sync()
        t = time.perf_counter()
        with autocast(dev, bf16):
            loss, losses, accs, _, accept = ttt_loss(model, head, batch, ttt, 0.8,
                                                           torch.bfloat16 if bf16 else torch.float32)
        grads = torch.autograd.grad(loss, params)
        sync()
        return (float(loss), [float(x) for x in losses], [float(x) for x in accs], grads,
                round(time.perf_counter() - t, 2), torch.cuda.max_memory_allocated() / 2**30 if cuda else 0)

    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    reset = torch.cuda.reset_peak_memory_stats if cuda else (lambda: None)
    for bf16 in (False, True):
        reset()
        ref = run(bf16, eager=True)
        if cuda and not getattr(model, "_compiled", False):
            model.compile_layers()
            model._compiled = True
        reset()
        new = run(bf16, eager=False)
        new2 = run(bf16, eager=False)  # compiled now: its time is the kernels'
        rel = [float((a - b).norm() / a.norm().clamp(min=1e-30)) for a, b in zip(ref[3], new[3])]
        out["bf16" if bf16 else "fp32"] = {
            "loss_ref": ref[0], "loss_gpu_path": new[0], "loss_rel_diff": abs(new[0] - ref[0]) / abs(ref[0]),
            "losses_max_abs_diff": max(abs(a - b) for a, b in zip(ref[1], new[1])),
            "acc_max_abs_diff": max(abs(a - b) for a, b in zip(ref[2], new[2])),
            "grad_rel_err_max": max(rel), "grad_rel_err_median": sorted(rel)[len(rel) // 2],
            "s_ref": ref[4], "s_gpu_path_first": new[4], "s_gpu_path": new2[4],
            "peak_gib_ref": round(ref[5], 2), "peak_gib_gpu_path": round(new2[5], 2)}
    os.environ.pop("EAGLE3_TRAIN_EAGER", None)
    return out


# ---- the child: one stage run, timed through its progress reports
def child(spec: dict) -> dict:
    import torch

    from eagle3_assets.worker.report import Reporter
    from eagle3_assets.worker.stages import run_stage

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    warmup, steps, profile = spec["warmup"], spec["steps"], spec.get("profile", 0)
    st = {"n": 0, "tok": 0, "t": None, "done": None, "prof": None}

    class Timed:
        def __init__(self, inner):
            self.inner = inner

        def update(self, n: int, tokens: int = 0):
            self.inner.update(n, tokens)
            if n != 1:
                return
            st["n"] += 1
            if warmup < st["n"] <= warmup + steps:
                st["tok"] += tokens
            if st["n"] in (warmup, warmup + steps):
                sync()
                now = time.perf_counter()
                if st["n"] == warmup:
                    st["t"] = now
                    if cuda:
                        st["peak_warmup"] = torch.cuda.max_memory_allocated()
                else:
                    st["done"] = now - st["t"]
                    if profile and cuda:  # the next steps, after the timed ones: where their time goes
                        st["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                                        torch.profiler.ProfilerActivity.CUDA])
                        st["prof"].__enter__()
            if st["prof"] is not None and st["n"] == warmup + steps + profile:
                sync()
                st["prof"].__exit__(None, None, None)
                table = st["prof"].key_averages().table(sort_by="self_cuda_time_total", row_limit=60)
                Path(spec["profile_out"]).write_text(f"{profile} steps\n{table}\n")
                st["prof"] = None

        def __getattr__(self, k):
            return getattr(self.inner, k)

    class BenchReporter(Reporter):
        def progress(self, what, total, unit="tokens", every_s=5.0):
            cm = super().progress(what, total, unit, every_s)
            if what != "train":
                return cm

            class Wrap:
                def __enter__(s):
                    return Timed(cm.__enter__())

                def __exit__(s, *exc):
                    return cm.__exit__(*exc)
            return Wrap()

        def materialize(self, metadata, data_version=None):
            self.meta = metadata

        def log(self, msg, level="info"):
            if msg.startswith(("batches:", "time budget")) or level != "info":
                st.setdefault("logs", []).append(msg[:300])
            super().log(msg, level)

    rep = BenchReporter()
    t0 = time.perf_counter()
    run_stage("train", spec["workdir"], spec["args"], rep)  # as the worker runs it: arguments validated first
    res = {"steps_timed": steps, "warmup_steps": warmup, "stage_wall_s": round(time.perf_counter() - t0, 1)}
    if st["done"]:
        res.update(tokens_timed=st["tok"], timed_s=round(st["done"], 3),
                   tokens_per_s=round(st["tok"] / st["done"], 1), step_s=round(st["done"] / steps, 4),
                   mean_fill=round(st["tok"] / (steps * spec["args"]["row_tokens"] * spec["args"]["rows_per_batch"]), 3))
    meta = getattr(rep, "meta", {})  # the stage's own figures: every step, the first (compiling) one too
    res.update(stage_steps=meta.get("steps"), stage_tokens_per_s=meta.get("tokens_per_s"),
               stage_train_wall_s=meta.get("wall_s"), loss_0=meta.get("loss_0"), acc_0=meta.get("acc_0"))
    # the loader (GPU): host time per batch, and the step loop's wait for batches over the whole run
    res.update({k: meta[k] for k in ("loader_batch_ms", "loader_wait_s") if k in meta})
    # what the stage says it trained from, and its GPU memory by holder (online: the target's weights too)
    res.update({k: v for k, v in meta.items() if k.startswith(("gpu_mem_", "hidden_state"))})
    if meta.get("loader_wait_s") is not None and meta.get("steps"):
        res["loader_wait_per_step_ms"] = round(1e3 * meta["loader_wait_s"] / meta["steps"], 1)
    # before the first step: shard checks, target labels, model set-up (the stage's wall less its training's)
    if meta.get("wall_s") is not None:
        res["stage_setup_s"] = round(res["stage_wall_s"] - meta["wall_s"], 1)
    res["logs"] = st.get("logs", [])
    try:  # where the stage's compile time went (dynamo frames, graphs, seconds per compiled function)
        from torch._dynamo.utils import compile_times, counters

        res["compile"] = {"frames": dict(counters["frames"]), "stats": dict(counters["stats"]),
                          "times": compile_times(repr="str")[-2500:]}
    except Exception as e:  # noqa: BLE001
        res["compile"] = repr(e)
    if cuda:
        res["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        res["peak_gpu_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--configs", default="1x8192:3,1x8192:7")
    ap.add_argument("--storage", default="fp8", help="shard storage(s) to train from, comma-separated: fp8 (the "
                    "extract stage's default) and/or native")
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps per config")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--workdir", default="/tmp/train_bench")
    ap.add_argument("--timeout-s", type=float, default=400)
    ap.add_argument("--profile", type=int, default=0, help="profile this many steps after the timed ones")
    ap.add_argument("--env", default="", help="extra environment for the runs, e.g. EAGLE3_TRAIN_COMPILE=0")
    ap.add_argument("--out", default=None, help="write the report (JSON) here")
    ap.add_argument("--check", default=None, metavar="T:TTT",
                    help="only compare the GPU path with the dense reference (GPU), rows of T tokens")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.check:
        T, ttt = map(int, a.check.split(":"))
        print(json.dumps(check(a.shape, T, ttt)), flush=True)
        return
    if a.child:
        print("BENCH_RESULT " + json.dumps(child(json.loads(a.child))), flush=True)
        return

    import torch

    from eagle3_assets.worker.training.trainer import PACK_WINDOW

    s = SHAPES[a.shape]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    configs = parse_configs(a.configs)
    wd = Path(a.workdir)
    t0 = time.perf_counter()
    # steps beyond the timed ones: the epoch's last rows (the packing window's leftovers) stay out of them
    extra = PACK_WINDOW + 2 + a.profile
    lengths = sample_lengths(configs, a.warmup, a.steps + extra, a.min_len, a.max_len,
                             PACK_WINDOW if device == "cuda" else 1)
    storages = a.storage.split(",")
    want = {"shape": s, "lengths": lengths, "storages": storages}
    meta = wd / "bench_meta.json"
    if not meta.exists() or json.loads(meta.read_text()) != want:
        import shutil

        shutil.rmtree(wd, ignore_errors=True)
        make_target(wd / "target", s, device)
        make_vocab(wd / "vocab" / "vocab_mapping.safetensors", s["vocab"], s["draft_vocab"])
        for storage in storages:
            make_shard(wd / "hidden_states" / storage / "shard-00000", s, lengths, device, storage)
        meta.write_text(json.dumps(want))
    setup_s = time.perf_counter() - t0
    report = {"bench": "train_stage", "shape": a.shape, "device": torch.cuda.get_device_name() if device == "cuda"
              else "cpu", "torch": torch.__version__, "samples": len(lengths), "tokens": sum(lengths),
              "sample_len": [a.min_len, a.max_len], "data_setup_s": round(setup_s, 1), "env": a.env, "runs": []}
    env = {**os.environ, "EAGLE3_NO_BAR": "1", **dict(kv.split("=", 1) for kv in a.env.split() if kv)}
    for storage, (rows, T, ttt) in ((st, c) for st in storages for c in configs):
        run_args = {"target": "target", "shards": [f"hidden_states/{storage}/shard-00000"],
                    "vocab": "vocab/vocab_mapping.safetensors", "out": f"drafter/{storage}_r{rows}x{T}_t{ttt}",
                    "epochs": 1,
                    "ttt_steps": ttt, "row_tokens": T, "rows_per_batch": rows, "probe_batches": 1, "resume": False}
        spec = {"workdir": str(wd), "args": run_args, "warmup": a.warmup, "steps": a.steps, "profile": a.profile,
                "profile_out": str(Path(a.out or wd / "x").parent / f"profile_r{rows}x{T}_t{ttt}.txt")}
        line = {"storage": storage, "tokens_per_step": rows * T, "rows_per_batch": rows, "row_tokens": T,
                "ttt_steps": ttt}
        tc = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, text=True,
                               capture_output=True, timeout=a.timeout_s)
            got = [x for x in p.stdout.splitlines() if x.startswith("BENCH_RESULT ")]
            if got:
                line.update(json.loads(got[-1].removeprefix("BENCH_RESULT ")))
            else:
                line["error"] = f"rc {p.returncode}: {p.stderr[-1500:]}"
        except subprocess.TimeoutExpired as e:
            line["error"] = f"timeout after {a.timeout_s:.0f} s: {(e.stderr or b'')[-800:]!r}"
        line["wall_s"] = round(time.perf_counter() - tc, 1)
        report["runs"].append(line)
        print(json.dumps(line), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
