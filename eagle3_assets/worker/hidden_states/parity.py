"""Hidden-state parity: the states an engine backend wrote into a shard against those of the transformers
forward on the same tokens, per aux layer and for the final state. Cosine alone misses a state scaled by a
constant (an embedding scaled in training but not in serving kept cosine at 1.000003 in an engine's tracker);
the norm ratio catches it, and all-zero states (an architecture whose capture the engine never wired) give a
ratio of 0."""

from __future__ import annotations

# How far the engine's states may sit from transformers' before the gate fails, per kind of target.
# Dense: both run the same float32 (or bf16) arithmetic in another kernel order; float8 storage adds ~1e-3 of
# cosine per token. MoE: bench/results/moe_agreement.json measured vLLM against transformers on a tiny MoE
# target (12,905 tokens, three router variants): the mean per-token cosine per layer stayed >= 0.9963, but up
# to 11 % of tokens fell below 0.99 (min 0.83), every such token one where a routing near-tie sent it to
# other experts (routed_apart_share up to 7.2 % of tokens). A gate on per-token minima would fail every MoE
# target, so it holds the mean over tokens, with room for that share of tokens routed apart; the norm ratio,
# which the study did not record, gets 5 %: a token routed apart moves its norm by far less than its
# direction, and the faults this is for are off by factors (x50, x0), not percents.
TOLERANCES = {
    "dense": {"max_norm_ratio_error": 0.02, "min_cosine": 0.99},
    "moe": {"max_norm_ratio_error": 0.05, "min_cosine": 0.98},
}


def compare(engine, reference, tolerance: dict) -> dict:
    """One layer's [T, H] states from the engine against the reference's: the ratio of their summed token
    norms, the mean per-token cosine, and whether both are within `tolerance`."""
    import torch

    e, r = engine.float(), reference.float()
    en, rn = e.norm(dim=-1), r.norm(dim=-1)
    ratio = float(en.sum() / rn.sum().clamp_min(1e-30))
    cos = float(torch.nn.functional.cosine_similarity(e, r, dim=-1, eps=1e-30).mean())
    zero = bool((en == 0).all())
    ok = not zero and abs(ratio - 1) <= tolerance["max_norm_ratio_error"] and cos >= tolerance["min_cosine"]
    return {"norm_ratio": round(ratio, 5), "cosine": round(cos, 5), "all_zero": zero, "passed": ok}


def parity(model, aux_layers: list[int], samples: list[dict], moe: bool) -> dict:
    """`samples`: {"input_ids", "aux" [T, 3H], "final" [T, H]} as the engine wrote them (float). Per layer
    ("aux layer i" for each aux id, "final"), over every sample's tokens: compare's figures; and the verdict."""
    import torch

    from .extract import HiddenStateCapture

    tolerance = TOLERANCES["moe" if moe else "dense"]
    capture = HiddenStateCapture(model, aux_layers)
    device = next(model.parameters()).device
    got: dict[str, list] = {}
    want: dict[str, list] = {}
    try:
        with torch.no_grad():
            for s in samples:
                aux, final = capture(torch.as_tensor(s["input_ids"], device=device)[None])
                h = final.shape[-1]
                for j, layer in enumerate(aux_layers):
                    got.setdefault(f"aux layer {layer}", []).append(s["aux"][:, j * h:(j + 1) * h])
                    want.setdefault(f"aux layer {layer}", []).append(aux[0, :, j * h:(j + 1) * h].cpu())
                got.setdefault("final", []).append(s["final"])
                want.setdefault("final", []).append(final[0].cpu())
    finally:
        capture.close()
    layers = {name: compare(torch.cat(got[name]), torch.cat(want[name]), tolerance) for name in got}
    failed = [name for name, v in layers.items() if not v["passed"]]
    return {"layers": layers, "passed": not failed, "failed_layers": failed, "kind": "moe" if moe else "dense",
            "tolerance": tolerance, "samples": len(samples), "tokens": sum(len(s["input_ids"]) for s in samples)}
