"""The EAGLE-3 draft head that vLLM and SGLang load as `LlamaForCausalLMEagle3`.

`fc` projects the target's 3 aux hidden states (3·H_target) to H; one decoder layer whose attention reads
[input_layernorm(token embedding), hidden_norm(hidden)] (2H wide), with the pre-norm hidden as residual;
`norm`; `lm_head` over the draft vocab. Token embeddings are the target's, frozen, and never exported.
Parameter names are the SGLang/SpecForge ones (`fc.*`, `midlayer.*`, `norm.*`, `lm_head.*`).

Attention over a training-time-test unroll: step 0 is causal over the sequence; a query at step i ≥ 1 and
position t sees step-0 keys at positions ≤ t (same document) and its own chain's keys of steps 1..i at t.
That is what a drafting chain sees at inference: the verified context, then its own draft tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


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
    rope_scaling: dict | None = None

    @classmethod
    def from_target(cls, tc, draft_vocab_size: int, aux_layer_ids: list[int]) -> "DraftConfig":
        heads = tc.num_attention_heads
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default") != "default" else None
        return cls(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size, num_attention_heads=heads,
                   num_key_value_heads=getattr(tc, "num_key_value_heads", heads),
                   head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
                   rms_norm_eps=tc.rms_norm_eps, rope_theta=float(theta),
                   max_position_embeddings=tc.max_position_embeddings, vocab_size=tc.vocab_size,
                   draft_vocab_size=draft_vocab_size, target_hidden_size=tc.hidden_size,
                   aux_layer_ids=list(aux_layer_ids), rope_scaling=scaling)

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
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        d, h, kv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        self.q_proj = nn.Linear(2 * c.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache: list, mask):
        """x: [B, T, 2H]. cache: keys/values of earlier unroll steps (step 0 first); this step's are appended.
        mask: bool [B, 1, T, T·(steps so far + 1)] or None for plain causal (step 0 of one document)."""
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        cache.append((k, v))
        keys = torch.cat([kk for kk, _ in cache], dim=2)
        vals = torch.cat([vv for _, vv in cache], dim=2)
        rep = c.num_attention_heads // c.num_key_value_heads
        if rep > 1:
            keys, vals = keys.repeat_interleave(rep, dim=1), vals.repeat_interleave(rep, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, keys, vals, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, embeds, hidden, cos, sin, cache, mask):
        residual = hidden  # norm_after_residual: what vLLM's and SGLang's plain EAGLE-3 layer does
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        h = residual + self.self_attn(x, cos, sin, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    def __init__(self, c: DraftConfig, embed_weight: torch.Tensor):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    def step(self, input_ids, hidden, positions, cache, mask):
        """One unroll step: returns the new (pre-norm) hidden state; logits = self.logits(hidden)."""
        cos, sin = rotary(positions, self.config.head_dim, self.config.rope_theta, hidden.dtype)
        return self.midlayer(self.embed_tokens(input_ids).to(hidden.dtype), hidden, cos, sin, cache, mask)

    def logits(self, hidden):
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]

    # -- checkpoint names: exactly the exported tensor names (no embed_tokens) --
    def export_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


def ttt_mask(doc: torch.Tensor, step: int) -> torch.Tensor:
    """Attention mask for unroll step `step` over packed rows. doc: [B, T] document ids (-1 = padding).
    Keys are [step-0 keys (T), step-1 keys (T), ..., this step's keys (T)]."""
    B, T = doc.shape
    idx = torch.arange(T, device=doc.device)
    same = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)
    causal = same & (idx[None, :, None] >= idx[None, None, :])
    parts = [causal]
    eye = torch.eye(T, dtype=torch.bool, device=doc.device)[None].expand(B, T, T)
    parts += [eye] * step
    m = torch.cat(parts, dim=-1)
    m = m | (doc[:, :, None] < 0) & eye.repeat(1, 1, step + 1)  # padding rows attend to something: no NaN
    return m[:, None]


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
