"""Stage `speculate` (offline acceptance): our own greedy chain speculative decoding with the target and the
drafter on held-out prompts. It is the reference that engine numbers are held against: acceptance length
(accepted + 1 per verify step, as vLLM and SGLang count it), per-position acceptance, and a check that the
output equals the target's own greedy output token for token.

Two methods, the same figures. `decode` runs the loop: draft k tokens, verify them in one target forward
with a KV cache, keep the accepted ones and the target's bonus token, repeat. `replay` (the default) uses
what greedy verification implies: the output *is* the target's greedy output, so that output is generated
first, for all prompts in batches (one target forward per token for the whole batch instead of one per verify
step and prompt), and each verify step is then replayed on the target's hidden states of one forward over
prompt + output: the drafter drafts from exactly the context it would have had, and its drafts are compared
with the tokens greedy verification would have produced. 4-8x fewer target forwards on a CPU, where this
stage ran at 5 tokens/s.

Replay measures every draft length from 1 to k in the same pass (`acceptance_length_k{j}`,
`acceptance_at_pos_{i}_k{j}`; the unsuffixed keys are k's): a greedy chain of j < k drafts is the first j of
the chain of k, so the chains drafted at k, one per start position, give each j's own trajectory exactly, on
the same target forward. An engine served with a speculation schedule drafts fewer than k at some loads; its
acceptance is held against the figure at the k it served. `decode` measures k alone (`acceptance_ks`)."""

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
    def __init__(self, target, drafter: Eagle3Drafter, k: int, tol: float = 1e-3):
        self.target, self.drafter, self.k, self.tol = target, drafter, k, tol
        self.capture = HiddenStateCapture(target, drafter.config.aux_layer_ids)

    def _target(self, ids: list[int], cache):
        out = self.target(input_ids=torch.tensor([ids], device=self.target.device), past_key_values=cache, use_cache=True)
        return out.logits[0].argmax(-1).tolist(), self.capture.last_aux()[0], out.past_key_values

    def _context(self, tokens: list[int], aux: torch.Tensor):
        """The drafter's step 0 over a context (aux[t] = target state after tokens[t], t < len(tokens) - 1):
        its hidden states [1, len(tokens) - 1, H] and cache. Causal: the state at position p is the same for
        every context that holds tokens[: p + 2], so one pass over a whole sequence serves each of its prefixes."""
        d, dev = self.drafter, self.drafter.fc.weight.device
        m = len(tokens)
        cache: list = []
        h = d.step(torch.tensor([tokens[1:m]], device=dev), d.combine(aux[None, : m - 1].to(d.fc.weight.dtype)),
                   torch.arange(m - 1, device=dev)[None], cache, None)
        return h, cache

    def _chain(self, h, cache0: list, m: int) -> list[int]:
        """k greedy draft tokens after a context of m tokens: h = the drafter's step-0 state at its last
        position [1, 1, H], cache0 = a step-0 cache holding (at least) its m - 1 positions."""
        d, dev = self.drafter, self.drafter.fc.weight.device
        cache = [[(k[:, :, : m - 1], v[:, :, : m - 1])] for ((k, v),) in cache0]  # the context's keys only
        see_all = torch.ones((1, 1, 1, m - 1), dtype=torch.bool, device=dev)  # the whole verified context
        out = []
        for j in range(self.k):
            nxt = d.to_target_ids(d.logits(h)[0, -1].argmax()).item()
            out.append(nxt)
            if j == self.k - 1:
                break
            h = d.step(torch.tensor([[nxt]], device=dev), h, torch.tensor([[m - 1 + j]], device=dev), cache, see_all)
        return out

    def _draft(self, tokens: list[int], aux: torch.Tensor) -> list[int]:
        """k greedy draft tokens after `tokens`; aux[t] = target state after tokens[t], t < len(tokens) - 1."""
        h, cache = self._context(tokens, aux)
        return self._chain(h[:, -1:], cache, len(tokens))

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new: int, eos: set[int]) -> tuple[list[int], list[int]]:
        """The decode loop. Returns (generated ids, accepted drafts per verify step); a step ends at an
        accepted end-of-sequence token, as the engines' do."""
        logits_arg, aux, cache = self._target(prompt, None)
        tokens = list(prompt) + [logits_arg[-1]]
        auxs = aux
        new, accepted = [tokens[-1]], []
        while len(new) < max_new and new[-1] not in eos:
            m = len(tokens)
            drafts = self._draft(tokens, auxs)
            g, aux, cache = self._target([tokens[-1]] + drafts, cache)
            a = 0
            while a < len(drafts) and drafts[a] == g[a] and drafts[a] not in eos:
                a += 1
            a += a < len(drafts) and drafts[a] == g[a]  # an accepted end-of-sequence ends the step
            accepted.append(a)
            auxs = torch.cat([auxs, aux[: a + 1]], dim=0)
            cache.crop(m + a)
            step_new = drafts[:a] + ([g[a]] if a == 0 or drafts[a - 1] not in eos else [])
            tokens += step_new
            new += step_new
        return _cut(new, max_new, eos), accepted

    @torch.inference_mode()
    def replay(self, prompt: list[int], greedy: list[int], max_new: int, eos: set[int],
               ks: list[int] | None = None) -> tuple[list[int], dict[int, list[int]], int | None]:
        """The decode loop's figures from the target's greedy continuation `greedy` (max_new + k tokens, or up
        to its end-of-sequence token): (output, {draft length: accepted drafts per verify step}, first output
        token that is not the target's greedy choice by the teacher-forced check, or None), for each draft length
        in `ks` (each at most k; default k alone). One target forward in all, and one drafted chain of k tokens
        per start position, shared by every draft length: a greedy chain of k' < k tokens is the first k' of the
        chain of k, so each length's own trajectory is replayed exactly."""
        P = len(prompt)
        ids = torch.tensor([list(prompt) + greedy[:-1]], device=self.target.device)
        logits = self.target(input_ids=ids, use_cache=False, logits_to_keep=len(greedy)).logits[0]
        aux = self.capture.last_aux()[0]  # aux[t]: the target's states after token t of prompt + greedy
        out = _cut(greedy, max_new, eos)
        h, cache = self._context(list(prompt) + greedy, aux)  # the drafter's context states, once
        chains: dict[int, list[int]] = {}

        def chain(n: int) -> list[int]:  # the k drafts after greedy[:n], memoized by start position
            if n not in chains:
                chains[n] = self._chain(h[:, P + n - 2: P + n - 1], cache, P + n)
            return chains[n]

        ks = sorted(set(ks or [self.k]), reverse=True)  # the longest first: its steps are the shorter ones' too
        if ks[0] > self.k or ks[-1] < 1:
            raise StageError(f"draft lengths {ks} must lie within 1-{self.k} (num_speculative_tokens)")
        return out, {k: _verify_steps(chain, greedy, max_new, eos, k) for k in ks}, \
            _not_greedy(logits[: len(out)], out, self.tol)


def _verify_steps(chain, greedy: list[int], max_new: int, eos: set[int], k: int) -> list[int]:
    """Accepted drafts per verify step of greedy chain speculation drafting k tokens a step, replayed on the
    target's greedy continuation `greedy`; chain(n): the drafter's chain (at least k tokens) after greedy[:n]."""
    n, accepted = 1, []  # greedy[0] comes from the prefill, as in the loop
    while n < max_new and greedy[n - 1] not in eos:
        drafts = chain(n)[:k]
        a, ended = 0, False
        while a < len(drafts) and n + a < len(greedy) and drafts[a] == greedy[n + a]:
            a += 1
            if greedy[n + a - 1] in eos:  # an accepted end-of-sequence ends the step: no bonus token
                ended = True
                break
        accepted.append(a)
        n += a + (not ended)
    return accepted


def _cut(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    out = tokens[:max_new]
    return next((out[: i + 1] for i, t in enumerate(out) if t in eos), out)


def greedy_continuations(target, prompts: list[list[int]], new_tokens: int, eos: set[int], pad_id: int,
                         batch_size: int, progress=None) -> list[list[int]]:
    """The target's greedy continuation of each prompt, up to `new_tokens` or its first end-of-sequence
    token, generated in left-padded batches."""
    outs: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i: i + batch_size]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, p in enumerate(chunk):
            ids[j, width - len(p):], mask[j, width - len(p):] = torch.tensor(p), 1
        with torch.inference_mode():
            gen = target.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                                  max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False, temperature=None,
                                  top_p=None, top_k=None, eos_token_id=sorted(eos), pad_token_id=pad_id)
        outs += [_cut(row, new_tokens, eos) for row in gen[:, width:].tolist()]
        if progress is not None:
            progress(len(chunk))
    return outs


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
    return _not_greedy(target(input_ids=ids, use_cache=False, logits_to_keep=len(out)).logits[0], out, tol)


def _not_greedy(logits, out: list[int], tol: float) -> int | None:
    """logits[i]: the target's after prompt + out[:i]."""
    logits = logits.float()
    chosen = logits.gather(-1, torch.tensor(out, device=logits.device)[:, None])[:, 0]
    bad = (logits.max(-1).values - chosen > tol).nonzero()
    return int(bad[0, 0]) if len(bad) else None


class Pair:
    """The target and the drafter, loaded side by side for replay or decoding."""

    def __init__(self, workdir: str, target: str, drafter: str, device: str, dtype: str | None, k: int):
        if k < 1:
            raise StageError(f"num_speculative_tokens must be at least 1, got {k}")
        target_dir = resolve(workdir, target)
        self.drafter_dir = resolve(workdir, drafter)
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.dtype = dtype or ("bfloat16" if self.device == "cuda" else "float32")
        self.k = k
        self.target = load_model(target_dir, self.dtype, self.device)
        self.tok = load_tokenizer(target_dir)
        tc = text_config(self.target.config)
        cfg, weights = load_drafter_dir(self.drafter_dir, tc)
        head = load_target_head(target_dir, tc.rms_norm_eps)
        drafter = Eagle3Drafter(cfg, head.embed.float())
        drafter.load_state_dict(weights, strict=False)
        drafter.to(device=self.device, dtype=getattr(torch, self.dtype)).eval()
        self.tol = GREEDY_TOLERANCE.get(self.dtype, 1e-3)
        self.spec = ChainSpeculator(self.target, drafter, k, self.tol)
        eos = self.target.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])

    def each(self, rows: list[dict], max_new: int, method: str, batch_size: int, reporter, label: str = "",
             every_k: bool = False):
        """Per prompt, in order: {id, accepted (drafts accepted per verify step), accepted_by_k (the same for each
        draft length measured: every one from 1 to k with `every_k` and replay, else k alone), tokens,
        not_greedy_at}."""
        prompts = [first_turn_prompt(self.tok, r["messages"]) for r in rows]
        name = f"{label} " if label else ""
        if method == "replay":  # k more tokens: what the last verify step compares its drafts with
            t0 = time.monotonic()
            with reporter.progress(f"{name}greedy outputs", len(rows), unit="prompts") as prog:
                greedy = greedy_continuations(self.target, prompts, max_new + self.k, self.eos, self.tok.pad_token_id,
                                              batch_size, lambda n: prog.update(n))
            reporter.log(f"{name}greedy outputs of {len(rows)} prompts in {time.monotonic() - t0:.1f} s (batches of "
                         f"{batch_size}); replaying each verify step on the target's hidden states")
        with reporter.progress(f"{name}acceptance", len(rows), unit="prompts") as prog:
            for i, (r, prompt) in enumerate(zip(rows, prompts)):
                if method == "replay":
                    out, by_k, at = self.spec.replay(prompt, greedy[i], max_new, self.eos,
                                                     list(range(1, self.k + 1)) if every_k else None)
                else:
                    out, accepted = self.spec.generate(prompt, max_new, self.eos)
                    by_k, at = {self.k: accepted}, first_non_greedy(self.target, prompt, out, self.tol)
                prog.update(1, tokens=len(out))
                yield {"id": r["id"], "accepted": by_k[self.k], "accepted_by_k": by_k, "tokens": len(out),
                       "not_greedy_at": at}


def figures(results: list[dict], k: int) -> dict:
    """Acceptance over prompts' verify steps, as the engines count it: length (accepted + 1 per step), rate, and
    per position."""
    steps = [a for r in results for a in r["accepted"]]
    n = max(len(steps), 1)
    per_pos = [sum(a > i for a in steps) / n for i in range(k)]
    return {"acceptance_length": round(sum(a + 1 for a in steps) / n, 4),
            "acceptance_rate": round(sum(steps) / (n * k), 4),
            "acceptance_per_pos": [round(p, 4) for p in per_pos], "verify_steps": len(steps)}


def run(workdir: str, args: SpeculateArgs, reporter) -> None:
    prompts_path = require_file(resolve(workdir, args.prompts), "eval prompts", "materialize the prompts asset first")
    k = int(args.num_speculative_tokens)
    pair = Pair(workdir, args.target, args.drafter, args.device, args.dtype, k)
    rows = pq.read_table(prompts_path).to_pylist()[: int(args.limit or 10**9)]
    if not rows:
        raise StageError(f"{prompts_path} holds no prompts")
    t0 = time.monotonic()
    results = list(pair.each(rows, int(args.max_new_tokens), args.method, int(args.batch_size), reporter,
                             every_k=True))
    wall = time.monotonic() - t0
    mismatches = [f"{r['id']}@{r['not_greedy_at']}" for r in results if r["not_greedy_at"] is not None]
    # each draft length measured (replay: every one up to k, each its own trajectory; decode: k alone), so that an
    # engine serving a lower k (a speculation schedule's at its load) is held against the figure at its own k
    per_k = {j: figures([{"accepted": r["accepted_by_k"][j]} for r in results], j) for j in results[0]["accepted_by_k"]}
    fig = per_k[k]
    meta = {
        "acceptance_length": fig["acceptance_length"],
        "acceptance_rate": fig["acceptance_rate"],
        **{f"acceptance_at_pos_{i}": p for i, p in enumerate(fig["acceptance_per_pos"])},
        "num_speculative_tokens": k,
        "acceptance_ks": sorted(per_k),
        **{f"acceptance_length_k{j}": f["acceptance_length"] for j, f in sorted(per_k.items())},
        **{f"acceptance_at_pos_{i}_k{j}": p for j, f in sorted(per_k.items())
           for i, p in enumerate(f["acceptance_per_pos"])},
        "verify_steps": fig["verify_steps"],
        "prompts": len(rows),
        "generated_tokens": sum(r["tokens"] for r in results),
        "output_matches_target_greedy": not mismatches,
        "mismatched_prompts": mismatches[:20],  # id@first token that is not the target's greedy choice
        "greedy_check": f"teacher-forced, tolerance {pair.tol}",
        "method": args.method,
        "dtype": pair.dtype,
        "wall_s": round(wall, 1),
        "drafter": str(pair.drafter_dir),
        "eval_set": str(prompts_path),
    }
    if mismatches:
        reporter.log(f"speculative output differs from the target's greedy output on {len(mismatches)} prompts "
                     f"({mismatches[:5]}, prompt id@token): a token the target would not have chosen greedily, by more than "
                     "the tie tolerance: " + ("the drafter's tokens are accepted without the target's check"
                                              if args.method == "decode" else "batched generation chose another "
                                              "token than an unbatched forward (a near tie, or padding leaking)"),
                     "warning")
    reporter.materialize(metadata=meta)
    reporter.result(meta)
