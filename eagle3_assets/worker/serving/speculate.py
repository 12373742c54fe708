"""Stage `speculate` (offline acceptance): our own greedy chain speculative decoding with the target and the
drafter on held-out prompts. It is the reference that engine numbers are held against: acceptance length
(accepted + 1 per verify step, as vLLM and SGLang count it), per-position acceptance, and a check that the
output equals the target's own greedy output token for token."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pyarrow.parquet as pq
import torch

from ..errors import StageError
from ..files import require_file, resolve
from ..hidden_states.extract import HiddenStateCapture
from ..target.chat import first_turn_prompt
from ..target.head import load_target_head
from ..target.model import load_model, load_tokenizer, text_config
from ..training.checkpoint import load_drafter_dir
from ..training.drafter import Eagle3Drafter

if TYPE_CHECKING:  # the contract, for annotations only: code_versions ties each stage to its own
    from ...stages.speculate import SpeculateArgs


class ChainSpeculator:
    def __init__(self, target, drafter: Eagle3Drafter, k: int):
        self.target, self.drafter, self.k = target, drafter, k
        self.capture = HiddenStateCapture(target, drafter.config.aux_layer_ids)

    def _target(self, ids: list[int], cache):
        out = self.target(input_ids=torch.tensor([ids], device=self.target.device), past_key_values=cache, use_cache=True)
        return out.logits[0].argmax(-1).tolist(), self.capture.last_aux()[0], out.past_key_values

    def _draft(self, tokens: list[int], aux: torch.Tensor) -> list[int]:
        """k greedy draft tokens after `tokens`; aux[t] = target state after tokens[t], t < len(tokens) - 1."""
        d, dev = self.drafter, self.drafter.fc.weight.device
        m = len(tokens)
        ids = torch.tensor([tokens[1:m]], device=dev)
        pos = torch.arange(m - 1, device=dev)[None]
        cache: list = []
        h = d.step(ids, d.combine(aux[None, : m - 1].to(d.fc.weight.dtype)), pos, cache, None)[:, -1:]
        out = []
        for j in range(self.k):
            nxt = d.to_target_ids(d.logits(h)[0, -1].argmax()).item()
            out.append(nxt)
            if j == self.k - 1:
                break
            see_all = torch.ones((1, 1, 1, m - 1), dtype=torch.bool, device=dev)  # the whole verified context
            h = d.step(torch.tensor([[nxt]], device=dev), h, pos[:, -1:] + j + 1, cache, see_all)
        return out

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new: int, eos: set[int]) -> tuple[list[int], list[int]]:
        """Returns (generated ids, accepted drafts per verify step)."""
        logits_arg, aux, cache = self._target(prompt, None)
        tokens = list(prompt) + [logits_arg[-1]]
        auxs = aux
        new, accepted = [tokens[-1]], []
        while len(new) < max_new and new[-1] not in eos:
            m = len(tokens)
            drafts = self._draft(tokens, auxs)
            g, aux, cache = self._target([tokens[-1]] + drafts, cache)
            a = 0
            while a < len(drafts) and drafts[a] == g[a]:
                a += 1
            accepted.append(a)
            auxs = torch.cat([auxs, aux[: a + 1]], dim=0)
            cache.crop(m + a)
            step_new = drafts[:a] + [g[a]]
            tokens += step_new
            new += step_new
        out = new[:max_new]
        for i, t in enumerate(out):
            if t in eos:
                return out[: i + 1], accepted
        return out, accepted


# How far below the best logit a chosen token may be and still count as the target's greedy choice: a tie
# broken the other way by a different batch shape is not a bug. float32 differs in the 6th digit; half
# precision in the 2nd-3rd.
GREEDY_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 2e-2}


@torch.inference_mode()
def first_non_greedy(target, prompt: list[int], out: list[int], tol: float) -> int | None:
    """Index of the first token of `out` that is not the target's greedy choice after prompt + out[:i], or
    None. One teacher-forced forward over the whole sequence: if every token is the argmax (up to `tol`),
    greedy decoding produces exactly `out`, so this checks losslessness at the cost of one prefill instead of
    a second token-by-token generation (the stage's slowest part on a CPU)."""
    ids = torch.tensor([list(prompt) + out[:-1]], device=target.device)
    logits = target(input_ids=ids, use_cache=False, logits_to_keep=len(out)).logits[0].float()
    chosen = logits.gather(-1, torch.tensor(out, device=logits.device)[:, None])[:, 0]
    bad = (logits.max(-1).values - chosen > tol).nonzero()
    return int(bad[0, 0]) if len(bad) else None


def run(workdir: str, args: SpeculateArgs, reporter) -> None:
    target_dir = resolve(workdir, args.target)
    prompts_path = require_file(resolve(workdir, args.prompts), "eval prompts", "materialize the prompts asset first")
    drafter_dir = resolve(workdir, args.drafter)
    device = args.device
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    k = int(args.num_speculative_tokens)
    max_new = int(args.max_new_tokens)
    if k < 1:
        raise StageError(f"num_speculative_tokens must be at least 1, got {k}")

    target = load_model(target_dir, dtype, device)
    tok = load_tokenizer(target_dir)
    tc = text_config(target.config)
    cfg, weights = load_drafter_dir(drafter_dir, tc)
    head = load_target_head(target_dir, tc.rms_norm_eps)
    drafter = Eagle3Drafter(cfg, head.embed.float())
    drafter.load_state_dict(weights, strict=False)
    drafter.to(device=device, dtype=getattr(torch, dtype)).eval()
    spec = ChainSpeculator(target, drafter, k)

    rows = pq.read_table(prompts_path).to_pylist()[: int(args.limit or 10**9)]
    if not rows:
        raise StageError(f"{prompts_path} holds no prompts")
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    steps, per_pos, mismatches, new_tokens = [], [0] * k, [], 0
    t0 = time.monotonic()
    with reporter.progress("offline acceptance", len(rows), unit="prompts") as prog:
        for r in rows:
            prompt = first_turn_prompt(tok, r["messages"])
            out, accepted = spec.generate(prompt, max_new, eos)
            at = first_non_greedy(target, prompt, out, GREEDY_TOLERANCE.get(dtype, 1e-3))
            if at is not None:
                mismatches.append(f"{r['id']}@{at}")
            steps += accepted
            for a in accepted:
                for i in range(a):
                    per_pos[i] += 1
            new_tokens += len(out)
            prog.update(1, tokens=len(out))
    wall = time.monotonic() - t0
    n = max(len(steps), 1)
    al = sum(a + 1 for a in steps) / n
    meta = {
        "acceptance_length": round(al, 4),
        "acceptance_rate": round(sum(steps) / (n * k), 4),
        **{f"acceptance_at_pos_{i}": round(per_pos[i] / n, 4) for i in range(k)},
        "num_speculative_tokens": k,
        "verify_steps": len(steps),
        "prompts": len(rows),
        "generated_tokens": new_tokens,
        "output_matches_target_greedy": not mismatches,
        "mismatched_prompts": mismatches[:20],  # id@first token that is not the target's greedy choice
        "greedy_check": f"teacher-forced, tolerance {GREEDY_TOLERANCE.get(dtype, 1e-3)}",
        "dtype": dtype,
        "wall_s": round(wall, 1),
        "drafter": str(drafter_dir),
        "eval_set": str(prompts_path),
    }
    if mismatches:
        reporter.log(f"speculative output differs from the target's greedy output on {len(mismatches)} prompts "
                     f"({mismatches[:5]}, prompt id@token): a token the target would not have chosen greedily, by more than "
                    "the tie tolerance: the drafter's tokens are accepted without the target's check", "warning")
    reporter.materialize(metadata=meta)
    reporter.result(meta)
