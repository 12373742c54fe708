"""The EAGLE-3 draft head that vLLM and SGLang load as `LlamaForCausalLMEagle3`.

`fc` projects the target's 3 aux hidden states (3·H_target) to H; one decoder layer whose attention reads
[input_layernorm(token embedding), hidden_norm(hidden)] (2H wide), with the pre-norm hidden as residual;
optionally more plain Llama layers after it (vLLM's `layers.{i}`, i >= 1); `norm`; `lm_head` over the draft
vocab. Token embeddings are the target's, frozen, and never exported. Parameter names are the SGLang/SpecForge
ones (`fc.*`, `midlayer.*`, `norm.*`, `lm_head.*`), and vLLM's `layers.{i}.*` for the later layers.

Attention over a training-time-test unroll: step 0 is causal over the sequence; a query at step i ≥ 1 and
position t sees step-0 keys at positions ≤ t (same document) and its own chain's keys of steps 1..i at t.
That is what a drafting chain sees at inference: the verified context, then its own draft tokens.
On the CPU that attention is `chain_attention` (dense, exact); on the GPU `chain_attention.py`'s flex path.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .chain_attention import ChainMasks, flex_chain_attention


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int           # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=list)  # output-of-layer convention
    num_hidden_layers: int = 1  # the first reads [embedding, hidden] (2H); the rest are plain Llama layers

    @classmethod
    def from_target(cls, tc, draft_vocab_size: int, aux_layer_ids: list[int]) -> DraftConfig:
        """A Llama-style draft layer of the target's text model's width (a wrapper's text_config)."""
        tc = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
        heads = tc.num_attention_heads
        if getattr(tc, "kv_lora_rank", None):
            # MLA (DeepSeek-V3, Kimi-K2): no grouped KV heads, and its `head_dim` is the rope part of a query.
            # The anchors' Kimi-K2.5 drafts (SpecForge kimi-k25-eagle3.json, TorchSpec kimi_k25_eagle3.json)
            # use every head for K/V and head_dim 128: the target's v_head_dim (7168 / 64 would be 112).
            kv, head_dim = heads, int(getattr(tc, "v_head_dim", None) or tc.hidden_size // heads)
        else:
            kv = getattr(tc, "num_key_value_heads", None) or heads
            head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
        # The draft uses plain RoPE at the target's theta, as SpecForge's drafts do; a target's rope scaling
        # (llama3, yarn) is not carried over, so training and serving agree.
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
        # intermediate_size: a MoE target's dense-layer width (Kimi-K2.5: 18432, as SpecForge's draft)
        return cls(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size, num_attention_heads=heads,
                   num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=tc.rms_norm_eps, rope_theta=float(theta),
                   max_position_embeddings=tc.max_position_embeddings, vocab_size=tc.vocab_size,
                   draft_vocab_size=draft_vocab_size, target_hidden_size=tc.hidden_size,
                   aux_layer_ids=list(aux_layer_ids))

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv  # [..., T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x, cos, sin):  # x: [B, heads, T, D]; cos/sin: [B, T, D]
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


class Attention(nn.Module):
    def __init__(self, c: DraftConfig, in_size: int):
        super().__init__()
        self.c = c
        d, h, kv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        self.q_proj = nn.Linear(in_size, h * d, bias=False)
        self.k_proj = nn.Linear(in_size, kv * d, bias=False)
        self.v_proj = nn.Linear(in_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache: list, mask0):
        """x: [B, T, 2H]. cache: (k, v) of earlier unroll steps, step 0 first; this step's are appended.
        mask0: bool [B, 1, T, T0] over the step-0 keys (None: plain causal), or the batch's ChainMasks (the
        GPU path: flex attention)."""
        q, k, v = self.project(x, cos, sin)
        return self.o_proj(self.attend(q, k, v, cache, mask0))

    def project(self, x, cos, sin, w=None):
        """w: the layer's weights cast once per forward (`Eagle3Drafter.cast_weights`), or None."""
        B, T, _ = x.shape
        c = self.c
        q = _linear(self.q_proj, x, w, 0).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = _linear(self.k_proj, x, w, 1).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = _linear(self.v_proj, x, w, 2).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def split_heads(self, y, cos, sin):
        """y [B, T, (h + 2 kv) d]: a fused q|k|v projection -> rotated q, k and v, as `project` returns them."""
        B, T, _ = y.shape
        c = self.c
        d, h, kv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        q, k, v = y.split([h * d, kv * d, kv * d], dim=-1)
        q = q.reshape(B, T, h, d).transpose(1, 2)
        k = k.reshape(B, T, kv, d).transpose(1, 2)
        v = v.reshape(B, T, kv, d).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(self, q, k, v, cache: list, mask0):
        """[B, T, heads * head_dim], before o_proj."""
        B, _, T, _ = q.shape
        c = self.c
        rep = c.num_attention_heads // c.num_key_value_heads
        cache.append((k, v))
        if isinstance(mask0, ChainMasks):
            out = flex_chain_attention(q, cache, mask0)
        elif len(cache) == 1:
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                 attn_mask=mask0, is_causal=mask0 is None)
        else:
            out = chain_attention(q, cache[0], cache[1:], mask0, rep)
        return out.transpose(1, 2).reshape(B, T, -1)


def chain_attention(q, step0, chain, mask0, rep: int):
    """A query at unroll step i and position t attends to the step-0 keys allowed by mask0 and to the keys
    of steps 1..i at its own position. Exact softmax over both, with T + i keys per query (not (i+1)·T)."""
    k0, v0 = (t.repeat_interleave(rep, 1) for t in step0)
    scale = q.shape[-1] ** -0.5
    s0 = (q @ k0.transpose(-1, -2)).float() * scale  # [B, h, T, T0]
    if mask0 is None:
        mask0 = torch.ones(s0.shape[-2:], dtype=torch.bool, device=q.device).tril()
    s0 = s0.masked_fill(~mask0, float("-inf"))
    sd = torch.stack([(q * kj.repeat_interleave(rep, 1)).sum(-1) for kj, _ in chain], -1).float() * scale
    m = torch.maximum(s0.amax(-1), sd.amax(-1)).detach()[..., None]
    p0, pd = torch.exp(s0 - m), torch.exp(sd - m)
    z = p0.sum(-1, keepdim=True) + pd.sum(-1, keepdim=True)
    out = p0.to(v0.dtype) @ v0
    for j, (_, vj) in enumerate(chain):
        out = out + pd[..., j:j + 1].to(vj.dtype) * vj.repeat_interleave(rep, 1)
    return (out.float() / z).to(q.dtype)


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x, w=None):
        return _linear(self.down_proj, F.silu(_linear(self.gate_proj, x, w, 4)) * _linear(self.up_proj, x, w, 5), w, 6)


class MidLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, 2 * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, embeds, hidden, cos, sin, cache, mask, w=None):
        # residual = hidden (norm_after_residual: what vLLM's and SGLang's plain EAGLE-3 layer does)
        q, k, v = self.qkv(embeds, hidden, cos, sin, w)
        return self.out(self.self_attn.attend(q, k, v, cache, mask), hidden, w)

    # The pieces around the attention: the same shapes at every unroll step, so compiled once (`compile_layers`).
    def qkv(self, embeds, hidden, cos, sin, w=None):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        return self.self_attn.project(x, cos, sin, w)

    def embed_qkv(self, embeds, w):
        """The GPU path's embedding half of the q/k/v projections, [B, T, (h + 2 kv) d]: the projections are
        per token and step i's tokens are step 0's shifted by i, so this is computed once per unroll (over
        the row and `steps` tokens past it) and each step reads its shifted window (`qkv_split`). w: the cast
        weights (`cast_weights`), whose last entry is the fused q|k|v weight [(h + 2 kv) d, 2H]."""
        H = self.hidden_norm.weight.shape[0]
        return F.linear(self.input_layernorm(embeds), w[7][:, :H])

    def qkv_split(self, emb_qkv, hidden, cos, sin, w):
        """`qkv` with the embedding half given (`embed_qkv`, this step's window): one matmul over the hidden
        half, added to it in the matmul (addmm), then rotary."""
        H = self.hidden_norm.weight.shape[0]
        B, T, _ = hidden.shape
        y = torch.addmm(emb_qkv.reshape(B * T, -1), self.hidden_norm(hidden).reshape(B * T, H), w[7][:, H:].t())
        return self.self_attn.split_heads(y.view(B, T, -1), cos, sin)

    def out(self, attn, residual, w=None):
        h = residual + _linear(self.self_attn.o_proj, attn, w, 3)
        return h + self.mlp(self.post_attention_layernorm(h), w)


class DecoderLayer(nn.Module):
    """A draft layer after the first (vLLM's `layers.{i}`, i >= 1): a plain pre-norm Llama layer."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, hidden, cos, sin, cache, mask, w=None):
        q, k, v = self.qkv(hidden, cos, sin, w)
        return self.out(self.self_attn.attend(q, k, v, cache, mask), hidden, w)

    def qkv(self, hidden, cos, sin, w=None):
        return self.self_attn.project(self.input_layernorm(hidden), cos, sin, w)

    def qkv_fused(self, hidden, cos, sin, w):
        """`qkv` with one matmul over the fused q|k|v weight (`cast_weights`' last entry)."""
        return self.self_attn.split_heads(F.linear(self.input_layernorm(hidden), w[7]), cos, sin)

    def out(self, attn, residual, w=None):
        h = residual + _linear(self.self_attn.o_proj, attn, w, 3)
        return h + self.mlp(self.post_attention_layernorm(h), w)


class Eagle3Drafter(nn.Module):
    def __init__(self, c: DraftConfig, embed_weight: torch.Tensor):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(c) for i in range(1, c.num_hidden_layers)})
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        # Training-only reparametrization of fc's input: one scale per aux layer (their hidden states differ
        # ~10x in size, so with Adam the small layers would barely move). Folded into fc.weight on export,
        # so the engines see a plain fc.
        self.register_buffer("aux_scale", torch.ones(3 * c.target_hidden_size))

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the 3 aux hidden states: the draft's hidden state for step 0."""
        return self.fc(aux * self.aux_scale.to(aux.dtype))

    def step(self, input_ids, hidden, positions, cache: list, mask, weights=None, emb_qkv=None, rope=None):
        """One unroll step: returns the new (pre-norm) hidden state; logits = self.logits(hidden). Pass the
        same `cache` (an empty list at the first step) to every step of one unroll. `weights`: from
        `cast_weights`, for every step of the unroll (or None: the modules' own). `emb_qkv` (the GPU path,
        with `weights`): this step's window of `embed_qkv`, in place of input_ids; the layers' q|k|v then
        come from their fused weights. `rope`: (cos, sin) of `positions`, made ahead (then positions is unused)."""
        cos, sin = rope if rope is not None else rotary(positions, self.config.head_dim, self.config.rope_theta,
                                                        hidden.dtype)
        if not cache:  # `cache` starts empty: one key/value list per layer, filled step by step
            cache.extend([] for _ in range(1 + len(self.layers)))
        w = weights[0] if weights is not None else [None] * (1 + len(self.layers))
        if emb_qkv is None:
            h = self.midlayer(self.embed_tokens(input_ids).to(hidden.dtype), hidden, cos, sin, cache[0], mask, w[0])
        else:
            m = self.midlayer
            q, k, v = m.qkv_split(emb_qkv, hidden, cos, sin, w[0])
            h = m.out(m.self_attn.attend(q, k, v, cache[0], mask), hidden, w[0])
        for i, layer in enumerate(self.layers.values(), 1):
            if emb_qkv is None:
                h = layer(h, cos, sin, cache[i], mask, w[i])
            else:
                q, k, v = layer.qkv_fused(h, cos, sin, w[i])
                h = layer.out(layer.self_attn.attend(q, k, v, cache[i], mask), h, w[i])
        return h

    def embed_qkv(self, input_ids, steps: int, weights):
        """The GPU path: the first layer's q|k|v projections of the token embeddings, once per unroll, over
        the row and `steps` padding tokens (id 0, as `shift` pads) past it: step i reads
        [:, i + 1: i + 1 + T]. [B, T + steps, (h + 2 kv) d]."""
        ids = torch.cat([input_ids, input_ids.new_zeros(input_ids.shape[0], steps)], dim=1)
        emb = self.embed_tokens(ids).to(weights[0][0][7].dtype)
        return self.midlayer.embed_qkv(emb, weights[0][0])

    def logits(self, hidden, lm_weight=None):
        """lm_weight: lm_head's weight cast once (`cast_weights`), or None."""
        return _linear(self.lm_head, self.norm(hidden), None if lm_weight is None else (lm_weight,), 0)

    def cast_weights(self, dtype) -> tuple:
        """The projection weights in the compute dtype, cast once for a whole unroll (GPU path, bf16
        autocast): as eager autocast caches its casts, so that each compiled piece neither casts them again
        at every step nor adds a float32 gradient per step (the steps' gradients meet in `dtype`, then one
        cast back). ([per layer: (q, k, v, o, gate, up, down, qkv)], lm_head): qkv is the fused q|k|v weight
        (one matmul where three would run), q, k and v are views of it."""
        layers = []
        for layer in (self.midlayer, *self.layers.values()):
            a, m = layer.self_attn, layer.mlp
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).to(dtype)
            q, k, v = qkv.split([a.q_proj.weight.shape[0], a.k_proj.weight.shape[0], a.v_proj.weight.shape[0]])
            layers.append((q, k, v, *(x.weight.to(dtype) for x in (a.o_proj, m.gate_proj, m.up_proj, m.down_proj)),
                           qkv))
        return layers, self.lm_head.weight.to(dtype)

    def compile_layers(self) -> None:
        """GPU path: compile each layer's pieces around its attention (norms, projections, rotary, MLP), whose
        shapes are the same at every unroll step, so each compiles once; the attention between them is
        `chain_attention`'s compiled flex kernel. Fuses the float32 norms and casts eager mode keeps in memory."""
        for layer in (self.midlayer, *self.layers.values()):
            for name in ("qkv", "out", "qkv_split", "qkv_fused", "embed_qkv"):
                if hasattr(layer, name):
                    setattr(layer, name, torch.compile(getattr(layer, name), dynamic=False))

    def to_target_ids(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]

    # -- checkpoint names: exactly the exported tensor names (no embed_tokens) --
    def export_state(self) -> dict[str, torch.Tensor]:
        state = {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens.", "aux_scale"))}
        state["fc.weight"] = state["fc.weight"] * self.aux_scale[None, :].to(state["fc.weight"].dtype)
        return state


def _linear(mod: nn.Linear, x, w, i: int):
    """mod(x), or with w[i] (a cast copy of mod.weight) in its place."""
    return mod(x) if w is None else F.linear(x, w[i])


def doc_causal_mask(doc: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, T, T]: causal within each packed document (doc ids, -1 = padding). Padding positions see
    themselves only, so no row is empty (an all-masked row would give NaN)."""
    T = doc.shape[1]
    idx = torch.arange(T, device=doc.device)
    causal = idx[:, None] >= idx[None, :]
    same = (doc[:, :, None] == doc[:, None, :]) & causal
    eye = torch.eye(T, dtype=torch.bool, device=doc.device)
    return (same | ((doc < 0)[:, :, None] & eye))[:, None]


# The tensors of a dense Llama-like target layer: what the draft layers can start from.
LLAMA_LAYER_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                       "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                       "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def init_extra_layer(layer: DecoderLayer, weights: dict[str, torch.Tensor]) -> None:
    """A later draft layer is a plain Llama layer: the target layer's weights as they are."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name not in weights or weights[name].shape != p.shape:
                raise ValueError(f"target layer has no {name} of shape {tuple(p.shape)}")
            p.copy_(weights[name].float())


def init_from_target_layer(model: Eagle3Drafter, layer: dict[str, torch.Tensor]) -> None:
    """Start the draft decoder layer from one of the target's: its attention reads both halves of its 2H
    input (token embedding, hidden) with the target layer's projections, its MLP and norms are the target's,
    and fc passes the top aux layer through. A language prior the few training samples cannot give."""
    m, f = model.midlayer, lambda k: layer[k].float()
    want = {"self_attn.q_proj.weight": m.self_attn.q_proj.weight.shape[:1],
            "self_attn.k_proj.weight": m.self_attn.k_proj.weight.shape[:1],
            "self_attn.v_proj.weight": m.self_attn.v_proj.weight.shape[:1], "mlp.gate_proj.weight": m.mlp.gate_proj.weight.shape}
    for name, shape in want.items():  # a dense Llama-like layer of the draft's shapes (not MoE, not MLA)
        if name not in layer or layer[name].shape[:len(shape)] != shape:
            raise ValueError(f"target layer has no {name} of shape {tuple(shape)}")
    with torch.no_grad():
        for proj in ("q_proj", "k_proj", "v_proj"):
            w = f(f"self_attn.{proj}.weight")
            getattr(m.self_attn, proj).weight.copy_(torch.cat([w, w], dim=1) * 0.5)
        m.self_attn.o_proj.weight.copy_(f("self_attn.o_proj.weight"))
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(m.mlp, name).weight.copy_(f(f"mlp.{name}.weight"))
        m.input_layernorm.weight.copy_(f("input_layernorm.weight"))
        m.hidden_norm.weight.copy_(f("input_layernorm.weight"))
        m.post_attention_layernorm.weight.copy_(f("post_attention_layernorm.weight"))
        h = model.config.hidden_size
        model.fc.weight.zero_()
        model.fc.weight[:, 2 * h:3 * h].copy_(torch.eye(h))


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
