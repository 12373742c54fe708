"""The two extraction backends side by side on the embedded target: the `hf` forward and vLLM with our KV
connector, on the same regenerated training conversations (bench/drafter_recipe.py's `prepare`: the
shipped 400 training prompts, replies regenerated greedily by the target on vLLM).

Measures, per backend: extraction tokens/s (the engine's work; vLLM's start reported apart), bytes per
token; the agreement of every layer, per token (cosine); and a drafter trained on each backend's shards
(the shipped recipe, fewer epochs) measured on the same held-out dev hidden states (hf).

    python bench/extract_backends.py [--epochs 5] [--dtype auto]

Writes bench/results/extract_backends.json. Name the CPU beside its figures (printed in the result).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import drafter_recipe as recipe  # noqa: E402
from eagle3_assets.worker.compute_dtype import cpu  # noqa: E402


def rows(shard: Path) -> dict[str, dict]:
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    m = json.loads((shard / "manifest.json").read_text())
    parts = {f["name"]: load_file(str(shard / f["name"])) for f in m["files"]}
    return {r["id"]: {k: v[r["offset"]: r["offset"] + r["length"]] for k, v in parts[r["part"]].items()}
            for r in pq.read_table(shard / "index.parquet").to_pylist()}


def agreement(a: Path, b: Path, hidden: int) -> dict:
    ra, rb = rows(a), rows(b)
    assert ra.keys() == rb.keys(), "the backends wrote different samples"
    out = {}
    for name, pick in [(f"aux{k}", lambda r, k=k: r["aux"][:, k * hidden:(k + 1) * hidden]) for k in range(3)] + \
            [("final", lambda r: r["final"])]:
        cos = torch.cat([torch.nn.functional.cosine_similarity(pick(ra[s]).float(), pick(rb[s]).float(), dim=-1)
                         for s in ra])
        out[name] = {"min": round(cos.min().item(), 6), "mean": round(cos.mean().item(), 6)}
    out["ids_identical"] = all(torch.equal(ra[s]["input_ids"], rb[s]["input_ids"]) and
                               torch.equal(ra[s]["loss_mask"], rb[s]["loss_mask"]) for s in ra)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    ns = ap.parse_args()
    w = ROOT / "bench" / "work" / "recipe"  # drafter_recipe.py's default workdir: its prepared data is reused
    if not (w / "prepared.json").exists():
        recipe.prepare(w, "vllm")
    info = json.loads((w / "prepared.json").read_text())
    n = __import__("pyarrow.parquet", fromlist=["x"]).read_metadata(w / "conversations" / "train.parquet").num_rows
    result = {"cpu": cpu(), "samples": n, "dtype": ns.dtype, "backends": {}}
    for backend in ("hf", "vllm"):
        out = w / "hidden_states" / f"train-{backend}"
        shutil.rmtree(out, ignore_errors=True)
        meta, res = recipe.stage(w, "extract", {"target": info["target"], "conversations": "conversations/train.parquet",
                                                "out_dir": str(out), "shard": 0, "samples_per_shard": n,
                                                "backend": backend, "dtype": ns.dtype})
        m = meta["manifest"]
        result["backends"][backend] = {
            "tokens": meta["tokens"], "tokens_per_s": meta["tokens_per_s"], "bytes_per_token": meta["bytes_per_token"],
            "dtype": meta["dtype"], "engine": f"{meta['engine']} {meta['engine_version']}",
            "stage_wall_s": res["_wall_s"], "engine_ready_s": m.get("engine_ready_s")}
        print(json.dumps({backend: result["backends"][backend]}), flush=True)
    hidden = json.loads((w / "hidden_states" / "train-hf" / "shard-00000" / "manifest.json").read_text())["hidden_size"]
    result["agreement"] = agreement(w / "hidden_states" / "train-hf" / "shard-00000",
                                    w / "hidden_states" / "train-vllm" / "shard-00000", hidden)
    print(json.dumps({"agreement": result["agreement"]}), flush=True)
    for backend in ("hf", "vllm"):
        meta, _ = recipe.stage(w, "train", {
            **recipe.RECIPES["shipped"], "epochs": ns.epochs, "target": info["target"],
            "shards": [str(w / "hidden_states" / f"train-{backend}" / "shard-00000")],
            "eval_shards": [str(w / "hidden_states" / "dev" / "shard-00000")],
            "vocab": "vocab/vocab_mapping.safetensors", "out": str(w / "drafters" / f"backend-{backend}"),
            "resume": False})
        result["backends"][backend]["heldout_acceptance_length_k3"] = meta["heldout_acceptance_length_k3"]
        result["backends"][backend]["heldout_accept"] = [meta[f"heldout_accept_{i}"] for i in range(3)]
        print(json.dumps({backend: result["backends"][backend]}), flush=True)
    dest = ROOT / "bench" / "results" / "extract_backends.json"
    dest.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
