"""bench/k0_off_switch.py's timing-only variant (on PYTHONPATH for one server): the k=0 plugin with the drafter's
KV cache left unwritten at k = 0. It damages acceptance after a k = 0 spell (tests/serving/test_k0_plugin.py shows
by how much) and is never shipped: it splits what a k = 0 step still costs into the K/V-only pass and the rest."""

import torch

from eagle3_assets.worker.engines.vllm import k0_plugin

k0_plugin._kv_only = lambda self, *args, **kw: torch.empty(args[5].batch_size(), 0, dtype=torch.int64)
