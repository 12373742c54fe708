"""A vLLM plugin that makes speculation free where the speculation schedule turns it off (k = 0).

vLLM's dynamic speculation (`num_speculative_tokens_per_batch_size`) still pays for the drafter at a step whose k
is 0: the V1 model runner (the one vLLM's CPU build runs; a GPU build with VLLM_USE_V2_MODEL_RUNNER=0) builds
spec-decode metadata and samples through the rejection sampler with zero drafts, and the EAGLE proposer runs the
drafter's whole forward over every scheduled token to keep its KV cache in sync (llm_base_proposer.py, the forward
before its early return). On 2 CPU cores that made a server at k = 0 0.90x a server without a drafter. Here:

- a step with no draft scheduled takes the plain path: no spec-decode metadata, the plain sampler (as Model Runner
  V2 already does); the runner's draft step then reads the step's tokens as a step without drafts;
- at k = 0 the drafter's KV cache is kept exact by a K/V-only pass: fc on the aux states, the norms, the QKV
  projection, rotary, the cache write; no attention, o_proj, MLP, final norm, lm_head nor the drafter's
  attention-metadata build. For a one-layer EAGLE-3 drafter the K/V a position writes depends only on the layer's
  input, and the pass computes it with the same ops on the same rows as the full forward: the cache holds the same
  bits, and acceptance after a busy spell is the stock engine's. A drafter of more than one layer (its later layers
  read the first one's attention) keeps vLLM's own path, said once in the log.

Opt-in per server: installed with eagle3-assets it is loaded by every vLLM of that environment (the entry point
`vllm.general_plugins`: eagle3_k0), but changes nothing unless the server is started with
`--additional-config '{"eagle3_k0": "kv_only"}'` (what the product's servers and launch files pass). Version-guarded:
on a vLLM it was not tested against it patches nothing and says so in the server's log. Standard library and vLLM
only: it runs inside the vLLM server, not in our worker."""

from __future__ import annotations

import logging

CONFIG_KEY = "eagle3_k0"  # in vLLM's --additional-config
MODE = "kv_only"
ADDITIONAL_CONFIG = {CONFIG_KEY: MODE}
TESTED = ("0.32.0",)  # the vLLM releases whose runner and proposer these patches were written against and tested on
_log = logging.getLogger("vllm.eagle3_k0")
_said: set[str] = set()


def _say_once(key: str, message: str, level: int = logging.INFO) -> None:
    if key not in _said:
        _said.add(key)
        _log.log(level, message)


def enabled(vllm_config) -> bool:
    extra = getattr(vllm_config, "additional_config", None)
    return isinstance(extra, dict) and extra.get(CONFIG_KEY) == MODE


def register() -> None:
    """vLLM's `vllm.general_plugins` hook, called in each of its processes before the model is built."""
    try:
        import vllm
    except ImportError:
        return
    version = getattr(vllm, "__version__", "unknown")
    base = version.split("+")[0]
    if base not in TESTED:
        _say_once("untested", f"eagle3-assets k=0 plugin: vLLM {version} is not a release it was tested against "
                  f"({', '.join(TESTED)}): it patches nothing, and k = 0 steps run vLLM's own path",
                  logging.WARNING)
        return
    _patch_runner()
    _patch_proposer()
    _say_once("installed", f"eagle3-assets k=0 plugin: loaded for vLLM {version}, inactive unless the server is "
              f"started with --additional-config '{{\"{CONFIG_KEY}\": \"{MODE}\"}}'", logging.DEBUG)


# ---- the V1 model runner: no spec-decode metadata, the plain sampler, at a step with no draft ------------------
def _patch_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock = GPUModelRunner._prepare_inputs
    if getattr(stock, "_eagle3_k0", False):  # loaded twice in one process
        return

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        spec = self.speculative_config
        if spec is None or not enabled(self.vllm_config) or \
                any(scheduler_output.scheduled_spec_decode_tokens.values()) or not _plain_ok(self, spec):
            return stock(self, scheduler_output, *args, **kwargs)
        _say_once("active", "eagle3-assets k=0 plugin: active: a step with no draft takes the plain sampler, and at "
                  "k = 0 the drafter keeps its KV cache by a K/V-only pass")
        # _prepare_inputs reads speculative_config for one thing only, whether to build the spec-decode metadata:
        # without it the step's logits are one a request and _sample takes the plain sampler
        self.speculative_config = None
        try:
            return stock(self, scheduler_output, *args, **kwargs)
        finally:
            self.speculative_config = spec

    _prepare_inputs._eagle3_k0 = True
    GPUModelRunner._prepare_inputs = _prepare_inputs


def _plain_ok(runner, spec) -> bool:
    """An EAGLE-3 drafter on a model without recurrent layers (their backends read the previous step's state at an
    offset only the speculative path applies, even with zero drafts)."""
    return spec.method == "eagle3" and not getattr(runner.model_config, "is_hybrid", True)


# ---- the EAGLE proposer: a K/V-only pass at k = 0 ------------------------------------------------------------
def _patch_proposer() -> None:
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    stock = SpecDecodeBaseProposer.propose
    if getattr(stock, "_eagle3_k0", False):
        return

    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None):
        if num_speculative_tokens == 0 and enabled(self.vllm_config) and _one_layer_eagle3(self):
            return _kv_only(self, target_token_ids, target_positions, target_hidden_states, next_token_ids,
                            token_indices_to_sample, common_attn_metadata, mm_embed_inputs, num_rejected_tokens_gpu)
        return stock(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                     next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                     mm_embed_inputs=mm_embed_inputs, num_rejected_tokens_gpu=num_rejected_tokens_gpu,
                     slot_mappings=slot_mappings)

    propose._eagle3_k0 = True
    SpecDecodeBaseProposer.propose = propose


def _one_layer_eagle3(proposer) -> bool:
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    model = proposer.model
    unwrap = getattr(model, "unwrap", None)
    model = unwrap() if callable(unwrap) else model
    if proposer.method != "eagle3" or type(model) is not Eagle3LlamaForCausalLM:
        _say_once("other-drafter", f"eagle3-assets k=0 plugin: {type(model).__name__} ({proposer.method}) is not a "
                  "Llama EAGLE-3 drafter: its k = 0 steps run vLLM's own drafter forward")
        return False
    if len(model.model.layers) != 1:
        _say_once("layers", f"eagle3-assets k=0 plugin: the drafter has {len(model.model.layers)} layers; its later "
                  "layers' K/V depend on the first one's attention, so its k = 0 steps run vLLM's own forward")
        return False
    return True


def _kv_only(self, target_token_ids, target_positions, target_hidden_states, next_token_ids,
             token_indices_to_sample, cad, mm_embed_inputs, num_rejected_tokens_gpu):
    """What vLLM's propose does at k = 0 up to its early return, with the drafter's forward cut to the cache write:
    the same inputs (set_inputs_first_pass), the same slot mapping, the same rows."""
    import torch
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention.attention import unified_kv_cache_update

    _say_once("kv_only", "eagle3-assets k=0 plugin: a k = 0 step: the drafter's K/V-only pass")
    batch_size = cad.batch_size()
    hidden = self.model.combine_hidden_states(target_hidden_states)
    num_tokens, _, cad = self.set_inputs_first_pass(
        target_token_ids=target_token_ids, next_token_ids=next_token_ids, target_positions=target_positions,
        target_hidden_states=hidden, token_indices_to_sample=token_indices_to_sample, cad=cad,
        num_rejected_tokens_gpu=num_rejected_tokens_gpu)
    kwargs, slot_mapping_size = self.build_model_inputs_first_pass(num_tokens, num_tokens, mm_embed_inputs)
    model = self.model.model
    layer = model.layers[0]
    attn = layer.self_attn
    with set_forward_context(None, self.vllm_config, num_tokens=num_tokens,
                             slot_mapping=self._get_slot_mapping(slot_mapping_size, cad.slot_mapping)):
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            embeds = model.embed_input_ids(kwargs["input_ids"])
        x, _ = layer._residual_norm(hidden_states=kwargs["hidden_states"])
        x = torch.cat([layer.input_layernorm(embeds), x], dim=-1)
        qkv, _ = attn.qkv_proj(x)  # q too: the same GEMM as the full forward's, so the same bits of K and V
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        _, k = attn.rotary_emb(kwargs["positions"], q, k)
        a = attn.attn
        unified_kv_cache_update(k.view(-1, a.num_kv_heads, a.head_size), v.view(-1, a.num_kv_heads, a.head_size_v),
                                a.layer_name)
    return torch.empty(batch_size, 0, device=hidden.device, dtype=torch.int64)
