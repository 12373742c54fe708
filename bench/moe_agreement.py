"""hf and vLLM hidden states of a MoE target, token by token, and where they part: the experts each
implementation routes every token to (issue 25 item 2).

A Kimi-K2.5-style target (tests/tiny_targets.py: a kimi_k25 wrapper around a DeepSeek-V3 text model, MLA with
latent width 320, Kimi's vocab) at the shape of the issue's report: 4 layers, hidden 256, q_lora 64, 8 routed
experts with 2 per token and 1 shared, the first layer dense. Each variant changes the routing:

- `moonshot`: the router named in the text config as Moonshot's and DeepSeek's configs name it
  (`scoring_func: sigmoid`, `topk_method: noaux_tc`), one expert group, the tests' random router (weights at
  std 0.1, correction biases within +-0.05);
- `no_scoring_func`: transformers' router init (weights at std 0.02, no bias) and `scoring_func` left out
  (vLLM then scores by softmax, transformers always by sigmoid). Leaving out `topk_method` too, as transformers'
  `DeepseekV3Config` writes a config, vLLM cannot load the checkpoint at all (`KeyError:
  'layers.1.mlp.gate.e_score_correction_bias'`, seen here);
- `init_router`: `no_scoring_func` with the key: the same weights routed alike by both, near-ties included
  (every score near 0.5);
- `groups`: `moonshot` with 4 groups of 2 experts, 2 groups per token (group-limited routing, as Kimi's).

Each extracts the same conversations with the hf backend and with vLLM (float32, native storage: no fp8 in
the comparison), then asks both for their routing: transformers' gates by hook, vLLM's CPU router by a patch its server
processes load (its own record, `--enable-return-routed-experts`, needs Model Runner V2, which the CPU build
lacks), one prompt at a time. A token's hidden state at layer L can only
differ if some token at or before it was routed differently at a layer <= L (attention carries it forward):
the report counts how many of the disagreeing tokens that explains. vLLM's routing comes from a second run,
one prompt at a time, while its extraction batched them: a near-tie can tip differently between the two runs, so
"explained" is a lower bound. Routing can also agree on the experts
and differ in their weights (softmax against sigmoid scores): the variant is also run through transformers
with the router vLLM builds from a config without the two keys (`no_scoring_func`), and compared with vLLM's shard.

    python bench/moe_agreement.py [--conversations 48] [--variants moonshot no_scoring_func init_router groups]

Needs bench/drafter_recipe.py's `prepare` (its dev conversations). Writes bench/results/moe_agreement.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]

import drafter_recipe as recipe  # noqa: E402
from eagle3_assets.worker.compute_dtype import cpu  # noqa: E402
from extract_backends import rows  # noqa: E402

SHAPE = dict(layers=4, hidden=256, heads=8, experts=8, experts_per_token=2, groups=1, topk_group=1, q_lora=64)
EAGER = ["--enforce-eager"]  # a CPU server ready in ~30 s, not ~110 s (extraction and routing alike)
VARIANTS = {
    "moonshot": {},
    "no_scoring_func": {"scoring_func": None, "router_std": 0.02, "router_bias": 0.0},
    "init_router": {"router_std": 0.02, "router_bias": 0.0},
    "groups": {"groups": 4, "topk_group": 2},
}


def build(w: Path, name: str):
    from tiny_targets import save_kimi_k25_like

    out = w / "targets" / name
    if not (out / "config.json").exists():
        save_kimi_k25_like(out, **{**SHAPE, **VARIANTS[name]})
    return out


def hf_routing(target: Path, ids: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Per sample: the experts transformers picks per (token, MoE layer), and the score margin between the
    last expert taken and the best one left (how near a tie the choice was)."""
    from eagle3_assets.worker.target.model import load_model, text_decoder

    model = load_model(target, "float32", "cpu")
    layers = text_decoder(model).layers
    seen = {}

    def hook(i):
        def grab(gate, args, out):
            logits, _, idx = out
            scores = logits.sigmoid() + gate.e_score_correction_bias
            k = idx.shape[-1]
            top = scores.topk(k + 1, dim=-1).values
            seen[i] = (idx.sort(dim=-1).values, top[:, k - 1] - top[:, k])
        return grab

    for i, layer in enumerate(layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(hook(i))
    out = {}
    with torch.no_grad():
        for sid, x in ids.items():
            seen.clear()
            model(input_ids=x.long()[None])
            out[sid] = {i: v for i, v in seen.items()}
    return out


def engine_default_router(gate, hidden_states):
    """vLLM's routing for a DeepSeek-V3 config without `scoring_func` / `topk_method` (its defaults: softmax,
    no correction bias, groups ranked by their best expert), in transformers' router interface."""
    h = hidden_states.view(-1, gate.hidden_dim)
    logits = torch.nn.functional.linear(h.float(), gate.weight.float())
    scores = logits.softmax(dim=-1)
    if gate.num_group > 1:
        best = scores.view(-1, gate.num_group, gate.num_experts // gate.num_group).amax(dim=-1)
        keep = torch.zeros_like(best).scatter_(1, best.topk(gate.topk_group, dim=-1).indices, 1.0)
        mask = keep.repeat_interleave(gate.num_experts // gate.num_group, dim=1).bool()
        scores = scores.masked_fill(~mask, 0.0)
    weights, idx = scores.topk(gate.top_k, dim=-1)
    if gate.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights * gate.routed_scaling_factor, idx


def hf_states(target: Path, ids: dict[str, torch.Tensor], router=None) -> dict[str, list[torch.Tensor]]:
    """transformers' hidden states per sample (index i + 1: the output of layer i), optionally with another
    router forward in place of transformers' own."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    from eagle3_assets.worker.target.model import load_model

    model = load_model(target, "float32", "cpu")
    own = ds.DeepseekV3TopkRouter.forward
    ds.DeepseekV3TopkRouter.forward = router or own
    try:
        with torch.no_grad():
            return {sid: [h[0] for h in model(input_ids=x.long()[None], output_hidden_states=True).hidden_states]
                    for sid, x in ids.items()}
    finally:
        ds.DeepseekV3TopkRouter.forward = own


# vLLM's own routing record (--enable-return-routed-experts) needs its Model Runner V2, which its CPU build lacks
# (no Triton): the server's processes instead load this patch of the CPU router, which saves each MoE layer's
# choice (one file per call, in call order) while the bench sends one prompt at a time.
_ROUTING_PATCH = """
import os
if os.environ.get("MOE_ROUTING_DUMP"):
    import itertools, torch
    from vllm.model_executor.layers.fused_moe.router import cpu_router
    _own, _n = cpu_router.CPURouter._compute_routing, itertools.count()

    def _compute_routing(self, hidden_states, router_logits, indices_type, **kw):
        weights, ids = _own(self, hidden_states, router_logits, indices_type, **kw)
        torch.save(ids.clone(), os.path.join(os.environ["MOE_ROUTING_DUMP"], f"{os.getpid()}-{next(_n):08d}.pt"))
        return weights, ids
    cpu_router.CPURouter._compute_routing = _compute_routing
"""


def vllm_routing(target: Path, ids: dict[str, torch.Tensor], w: Path, name: str,
                 moe_layers: list[int]) -> dict[str, torch.Tensor]:
    """The experts vLLM picked for every prompt token, [tokens, layers, k] per sample (dense layers: -1)."""
    import os
    import shutil

    import requests

    from eagle3_assets.worker.engines.server import EngineServer, free_port
    from eagle3_assets.worker.engines.vllm import SERVER_ENV, server_command

    patch, dump = w / "routing_patch", w / "routing_dump" / name
    shutil.rmtree(dump, ignore_errors=True)
    patch.mkdir(parents=True, exist_ok=True)
    dump.mkdir(parents=True)
    (patch / "sitecustomize.py").write_text(_ROUTING_PATCH)
    port = free_port()
    argv = server_command(sys.executable, str(target), port, drafter=None, k=0, dtype="float32",
                          max_model_len=2048, seed=0, language_model_only=True,
                          extra=["--no-enable-prefix-caching", *EAGER])
    env = {**SERVER_ENV, "MOE_ROUTING_DUMP": str(dump),
           "PYTHONPATH": os.pathsep.join([str(patch), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = {}
    with EngineServer("vllm", argv, port, w / f"routing-{name}.log", env=env) as server:
        server.wait_ready(900)
        for sid, x in ids.items():
            before = set(dump.iterdir())
            r = requests.post(f"{server.base_url}/v1/completions", timeout=600, json={
                "model": "target", "prompt": x.tolist(), "max_tokens": 1, "temperature": 0.0})
            r.raise_for_status()
            calls = [torch.load(f) for f in sorted(set(dump.iterdir()) - before, key=lambda f: f.name.split("-")[1])]
            calls = [c for c in calls if c.shape[0] == len(x)]  # the prompt's forward (not a 1-token step)
            if len(calls) != len(moe_layers):
                raise SystemExit(f"{sid}: {len(calls)} routing calls of {len(x)} tokens, expected {len(moe_layers)}")
            got = torch.full((len(x), max(moe_layers) + 1, calls[0].shape[1]), -1, dtype=torch.long)
            for layer, c in zip(moe_layers, calls):
                got[:, layer] = c.long()
            out[sid] = got
    return out


def compare(hf_dir: Path, vllm_dir: Path, hf_route: dict, vllm_route: dict, aux_ids: list[int], hidden: int) -> dict:
    a, b = rows(hf_dir), rows(vllm_dir)
    moe_layers = sorted(next(iter(hf_route.values())))
    layer_of = {f"aux{k}": aux_ids[k] for k in range(len(aux_ids))}
    layer_of["final"] = max(moe_layers)
    cos = {name: [] for name in layer_of}
    explained = {name: [] for name in layer_of}
    routed_apart = {i: 0 for i in moe_layers}
    margins_apart, margins_all, tokens = [], [], 0
    for sid in a:
        n = a[sid]["input_ids"].shape[0]
        tokens += n
        v = vllm_route[sid][:n]
        # per MoE layer: does this token's set of experts differ?
        apart = {}
        for i in moe_layers:
            mine, margin = hf_route[sid][i]
            theirs = v[:, i].sort(dim=-1).values
            apart[i] = (mine[:n] != theirs).any(dim=-1)
            routed_apart[i] += int(apart[i].sum())
            margins_all.append(margin[:n])
            margins_apart.append(margin[:n][apart[i]])
        for name, L in layer_of.items():
            x = a[sid]["aux"][:, int(name[3:]) * hidden:(int(name[3:]) + 1) * hidden] if name != "final" \
                else a[sid]["final"]
            y = b[sid]["aux"][:, int(name[3:]) * hidden:(int(name[3:]) + 1) * hidden] if name != "final" \
                else b[sid]["final"]
            cos[name].append(torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1))
            # the output of layer L depends on the routing of this token at layers <= L and of earlier tokens
            # at layers < L (their keys and values at layer L come from what those layers wrote)
            own = torch.zeros(n, dtype=torch.bool)
            earlier = torch.zeros(n, dtype=torch.bool)
            for i in moe_layers:
                if i <= L:
                    own |= apart[i]
                if i < L:
                    earlier |= apart[i]
            explained[name].append(own | (earlier.cumsum(0) > 0))
    report = {"tokens": tokens, "routed_apart_share": {str(i): round(c / tokens, 4) for i, c in routed_apart.items()}}
    ma, mall = torch.cat(margins_apart), torch.cat(margins_all)
    report["margin"] = {"median_all": float(mall.median()), "median_routed_apart": float(ma.median()) if len(ma) else None,
                        "max_routed_apart": float(ma.max()) if len(ma) else None}
    for name in layer_of:
        c, e = torch.cat(cos[name]), torch.cat(explained[name])
        bad = c < 0.99
        report[name] = {"layer": layer_of[name], "mean": round(c.mean().item(), 6), "min": round(c.min().item(), 6),
                        "below_0.99": round(bad.float().mean().item(), 4),
                        "below_0.99_explained_by_routing": round((bad & e).sum().item() / max(1, bad.sum().item()), 4),
                        "min_where_routing_agrees": round(c[~e].min().item(), 6) if (~e).any() else None}
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ns = ap.parse_args()
    import pyarrow.parquet as pq

    w = ROOT / "bench" / "work" / "moe"
    (w / "conversations").mkdir(parents=True, exist_ok=True)
    src = ROOT / "bench" / "work" / "recipe" / "conversations" / "dev.parquet"
    if not src.exists():
        sys.exit(f"{src} is missing: run `python bench/drafter_recipe.py prepare` first")
    pq.write_table(pq.read_table(src).slice(0, ns.conversations), w / "conversations" / "convs.parquet")
    results = {"cpu": cpu(), "shape": SHAPE, "conversations": ns.conversations, "variants": {}}
    for name in ns.variants:
        target = build(w, name)
        common = {"target": str(target), "conversations": "conversations/convs.parquet", "shard": 0,
                  "samples_per_shard": ns.conversations, "dtype": "float32", "storage": "native"}
        t0 = time.monotonic()
        for backend in ("hf", "vllm"):
            out = w / "shards" / name / backend
            if not (out / "shard-00000" / "manifest.json").exists():
                recipe.stage(w, "extract", {**common, "backend": backend, "out_dir": str(out),
                                            **({"ready_timeout_s": 900, "extra_args": EAGER} if backend == "vllm"
                                               else {})})
        manifest = json.loads((w / "shards" / name / "hf" / "shard-00000" / "manifest.json").read_text())
        ids = {sid: r["input_ids"] for sid, r in rows(w / "shards" / name / "hf" / "shard-00000").items()}
        hf_route = hf_routing(target, ids)
        vllm_route = vllm_routing(target, ids, w, name, sorted(next(iter(hf_route.values()))))
        got = compare(w / "shards" / name / "hf" / "shard-00000", w / "shards" / name / "vllm" / "shard-00000",
                      hf_route, vllm_route, manifest["aux_layer_ids"], manifest["hidden_size"])
        if "scoring_func" in VARIANTS[name]:  # transformers with vLLM's reading of the config
            emulated = hf_states(target, ids, engine_default_router)
            theirs = rows(w / "shards" / name / "vllm" / "shard-00000")
            H = manifest["hidden_size"]
            got["hf_with_engine_default_router_vs_vllm_min"] = {
                f"aux{k}": round(torch.cat([torch.nn.functional.cosine_similarity(
                    emulated[sid][layer + 1].float(), theirs[sid]["aux"][:, k * H:(k + 1) * H].float(), dim=-1)
                    for sid in ids]).min().item(), 6)
                for k, layer in enumerate(manifest["aux_layer_ids"])}
        got["settings"] = VARIANTS[name]
        got["wall_s"] = round(time.monotonic() - t0, 1)
        results["variants"][name] = got
        print(json.dumps({name: got}, indent=2), flush=True)
    out = ROOT / "bench" / "results" / "moe_agreement.json"
    old = json.loads(out.read_text()) if out.exists() else {"variants": {}}
    old.update({k: v for k, v in results.items() if k != "variants"})
    old["variants"].update(results["variants"])
    out.write_text(json.dumps(old, indent=2) + "\n")


if __name__ == "__main__":
    main()
