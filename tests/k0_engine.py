"""vLLM's offline engine on given token ids, each request its own reply length, all submitted before the first
step (a server's requests arrive step by step, and which step each joins moves the batch sizes and so the k each
step drafts): the texts and the spec-decode counters, as one JSON line. Run by test_k0_plugin.py in a process of
its own (the plugin patches vLLM's classes process-wide):

    python tests/k0_engine.py '{"target", "spec", "additional", "prompts", "max_tokens", "no_sync"?}'"""

import json
import sys

a = json.loads(sys.argv[1])
if a.get("no_sync"):  # the drafter's KV cache left unwritten at k = 0: what a broken sync does to acceptance
    import torch

    from eagle3_assets.worker.engines.vllm import k0_plugin

    k0_plugin._kv_only = lambda self, *args, **kw: torch.empty(args[5].batch_size(), 0, dtype=torch.int64)
from vllm import LLM, SamplingParams  # noqa: E402

llm = LLM(model=a["target"], speculative_config=a["spec"], dtype="float32", enforce_eager=True, max_model_len=1024,
          seed=0, additional_config=a["additional"], distributed_executor_backend="uni", disable_log_stats=False)
outs = llm.generate([{"prompt_token_ids": ids} for ids in a["prompts"]],
                    [SamplingParams(temperature=0, max_tokens=n) for n in a["max_tokens"]], use_tqdm=False)
counters = {m.name.removeprefix("vllm:spec_decode_"): getattr(m, "values", getattr(m, "value", None))
            for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
print("RESULT " + json.dumps({"texts": [o.outputs[0].text for o in outs], "counters": counters}), flush=True)
