"""The torch modules of the draft heads that read the target's own hidden states: EAGLE, EAGLE-3, Medusa.

All reuse the target's embedding (``FrozenTarget``: frozen; EAGLE and Medusa also its LM head, cut
to a reduced draft vocabulary) and train only their own small weights (``train_draft.py``).

* ``EagleHead``: one Llama-style decoder layer over ``fc(concat(embed(x[i+1]), f[i]))``; it
  predicts the target's next feature ``f[i+1]``, whose LM-head logits give the token after
  ``x[i+1]``. Features are the target graph's ``hidden_states`` (after the final norm), so
  the LM head applies to them directly. It keeps its own small KV cache at run time.
* ``Eagle3Head``: EAGLE-3. One decoder layer over ``(embed(x[i+1]), h[i])``, where ``h[i]`` is
  ``fc`` of the target's features of token i from several layers (low, middle, high:
  ``layer_features``) for committed tokens, and the head's own previous output for draft tokens.
  It predicts no feature: its own norm and LM head over the draft vocabulary give the token after
  ``x[i+1]``, and its output (before that norm) is what the next draft step reads. Trained with
  "training-time test" (``head_losses.eagle3_loss``), i.e. on its own outputs several steps deep.
  The layout of vLLM's and SGLang's ``LlamaForCausalLMEagle3`` (``eagle3_checkpoint.py``).
* ``MedusaHeads``: K residual blocks ``h + SiLU(W_i h + b_i)``; head i on ``f[t]`` predicts
  the token ``x[t+1+i]``.

How each is configured, trained and exported is its recipe (``head_recipes.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn


@dataclass
class HeadConfig:
    """Sizes of a head, saved as a heads folder's ``config.json``; ``training`` is the training summary."""

    method: str  # a key of head_recipes.RECIPES: "eagle" | "medusa"
    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab: int  # rows of the (reduced) LM head
    num_heads: int = 0  # eagle attention heads
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    medusa_heads: int = 0
    # EAGLE-3: the target layers whose entering residual streams it reads (0 = the embedding), and the
    # draft steps unrolled in training (training-time test)
    feature_layers: list = field(default_factory=list)
    ttt_steps: int = 0
    training: dict = field(default_factory=dict)


EAGLE3_NORM_INIT = 0.25  # the EAGLE-3 head's final norm starts at this fraction of the target's


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers of a ``num_layers`` target: (2, L // 2, L - 3), as vLLM picks
    them by default, kept inside 0..L-1 (tiny targets)."""
    return tuple(sorted(min(max(k, 0), num_layers - 1) for k in (2, num_layers // 2, num_layers - 3)))


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, positions, theta):  # x [B, n, S, hd], positions [B, S]
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    freqs = positions[:, None, :, None].float() * inv  # [B, 1, S, hd/2]
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    rot = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


class FrozenTarget(nn.Module):
    """The target's embedding and (draft-vocabulary) LM head, as buffers that are never trained.

    ``final_norm`` [H]: the target's final norm weight, where known: EAGLE-3's own norm starts from it.
    ``feature_scale`` [n*H]: the typical size of each layer-feature dimension in the training data (EAGLE-3
    trains on features divided by it, see ``Eagle3Head.fuse``)."""

    def __init__(
        self,
        embed: np.ndarray,
        lm_head: np.ndarray,
        vocab_ids: np.ndarray,
        embed_dtype=np.float16,
        *,
        final_norm=None,
        feature_scale=None,
    ):
        super().__init__()
        self.final_norm = None if final_norm is None else torch.as_tensor(np.asarray(final_norm, np.float32))
        self.feature_scale = None if feature_scale is None else torch.as_tensor(np.asarray(feature_scale, np.float32))
        # The full-vocabulary embedding is the biggest tensor of a head graph: fp16, or the dtype of the target
        # graph's own table when the head graph reads that one (head_export.py).
        self.register_buffer("embed", torch.as_tensor(np.asarray(embed, embed_dtype)), persistent=False)  # [V, H]
        head = np.asarray(lm_head, np.float32)[np.asarray(vocab_ids)]
        self.register_buffer("lm_head_t", torch.as_tensor(np.ascontiguousarray(head.T)), persistent=False)  # [H, V']
        self.register_buffer("vocab_ids", torch.as_tensor(np.asarray(vocab_ids, np.int64)), persistent=False)  # [V']

    def embed_tokens(self, ids):  # [...] -> [..., H]
        return self.embed[ids].float()

    def logits(self, x):  # [..., H] -> [..., V']
        return x @ self.lm_head_t


def attention(head: nn.Module, h, positions, past_key, past_value, bias):
    """Grouped-query attention of ``head`` (its q/k/v projections and ``cfg``) over its cache and the new rows.

    h [B, S, D] (the layer's normed input), positions [B, S], past K/V [B, P, kvh, hd], bias [B, 1, S, P+S]
    -> attention output [B, S, nh * hd], new key and value [B, S, kvh, hd]."""
    cfg = head.cfg
    B, S, _ = h.shape
    q = head.q_proj(h).view(B, S, cfg.num_heads, cfg.head_dim).transpose(1, 2)  # [B, nh, S, hd]
    k = head.k_proj(h).view(B, S, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)  # [B, kvh, S, hd]
    v = head.v_proj(h).view(B, S, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
    q, k = rotate(q, positions, cfg.rope_theta), rotate(k, positions, cfg.rope_theta)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, S, kvh, hd]
    keys, values = torch.cat([past_key, k], 1).transpose(1, 2), torch.cat([past_value, v], 1).transpose(1, 2)
    g = cfg.num_heads // cfg.num_kv_heads
    keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)  # [B, nh, P+S, hd]
    scores = q @ keys.transpose(-1, -2) * cfg.head_dim**-0.5 + bias  # [B, nh, S, P+S]
    return (scores.softmax(-1) @ values).transpose(1, 2).reshape(B, S, -1), k, v


class EagleHead(nn.Module):
    """One decoder layer that predicts the target's next feature from the current one and the next token."""

    def __init__(self, cfg: HeadConfig, target: FrozenTarget):
        super().__init__()
        self.cfg, self.target = cfg, target
        H, nh, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.q_proj, self.k_proj = nn.Linear(H, nh * hd, bias=False), nn.Linear(H, kvh * hd, bias=False)
        self.v_proj, self.o_proj = nn.Linear(H, kvh * hd, bias=False), nn.Linear(nh * hd, H, bias=False)
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)
        self.input_norm, self.post_norm = nn.Parameter(torch.ones(H)), nn.Parameter(torch.ones(H))
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, features, input_ids, positions, past_key, past_value, bias):
        """features [B, S, H] (f[i]), input_ids [B, S] (x[i+1]), positions [B, S], past K/V
        [B, P, kvh, hd], bias [B, 1, S, P+S] -> predicted f[i+1] [B, S, H], new key and value [B, S, kvh, hd].

        The cache is BSNH so that the host's committed prefix is a contiguous slice (no copy)."""
        cfg = self.cfg
        x = self.fc(torch.cat([self.target.embed_tokens(input_ids), features], -1))  # [B, S, H]
        h = rms_norm(x, self.input_norm, cfg.rms_eps)
        attn, k, v = attention(self, h, positions, past_key, past_value, bias)
        x = x + self.o_proj(attn)
        h = rms_norm(x, self.post_norm, cfg.rms_eps)
        x = x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))
        return x, k, v


class Eagle3Head(nn.Module):
    """EAGLE-3: one decoder layer over the token's embedding and a fused (or its own earlier) feature."""

    def __init__(self, cfg: HeadConfig, target: FrozenTarget):
        super().__init__()
        self.cfg, self.target = cfg, target
        H, nh, kvh, hd, inter = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        width = len(cfg.feature_layers) * H
        self.fc = nn.Linear(width, H, bias=False)  # fusion of the target's layer features
        self.q_proj, self.k_proj = nn.Linear(2 * H, nh * hd, bias=False), nn.Linear(2 * H, kvh * hd, bias=False)
        self.v_proj, self.o_proj = nn.Linear(2 * H, kvh * hd, bias=False), nn.Linear(nh * hd, H, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(H, inter, bias=False), nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)
        for p in self.parameters():
            nn.init.normal_(p, 0.0, 0.02)
        self.input_norm, self.hidden_norm = nn.Parameter(torch.ones(H)), nn.Parameter(torch.ones(H))  # embed, feature
        self.post_norm = nn.Parameter(torch.ones(H))
        # Its own final norm and LM head over the draft vocabulary [V', H], starting from the target's.
        # Scaled down so that the untrained head's draft distribution starts nearly flat, not confidently
        # wrong: with the target's full norm the first loss is ~3x that of a uniform guess.
        norm = torch.ones(H) if target.final_norm is None else target.final_norm.clone()
        self.norm = nn.Parameter(EAGLE3_NORM_INIT * norm)
        self.lm_head = nn.Parameter(target.lm_head_t.T.clone())
        scale = torch.ones(width) if target.feature_scale is None else target.feature_scale
        self.register_buffer("feature_scale", scale.clone(), persistent=False)

    def fuse(self, target_features):
        """[..., n*H] -> [..., H]: ``fc`` of the target's layer features.

        Training divides the features by their typical size per dimension first (``feature_scale``): the
        residual streams have a few dimensions hundreds of times larger than the rest, and Adam's equal
        steps per weight would move the output mostly along those. ``fold_feature_scale`` moves the
        division into ``fc``'s weights, so a saved head computes plain ``fc`` (the reference layout)."""
        return self.fc(target_features / self.feature_scale)

    def fold_feature_scale(self) -> None:
        """Fold ``feature_scale`` into ``fc.weight`` (the same function, with unit scales)."""
        with torch.no_grad():
            self.fc.weight.div_(self.feature_scale)
            self.feature_scale.fill_(1.0)

    def unfold_feature_scale(self) -> None:
        """The inverse of ``fold_feature_scale`` for this run's ``feature_scale``: weights saved folded (they read
        raw features) made to read the scaled ones, computing the same function (``train-draft --init``)."""
        with torch.no_grad():
            self.fc.weight.mul_(self.feature_scale)

    def layer_input(self, hidden, input_ids):
        """[..., 2H]: the normed embedding of ``input_ids`` [...] beside the normed feature ``hidden`` [..., H]."""
        eps = self.cfg.rms_eps
        emb = rms_norm(self.target.embed_tokens(input_ids), self.input_norm, eps)
        return torch.cat([emb, rms_norm(hidden, self.hidden_norm, eps)], -1)

    def finish(self, hidden, attn):
        """The layer's output [..., H] (before the final norm) from its input feature and attention output."""
        x = hidden + self.o_proj(attn)
        h = rms_norm(x, self.post_norm, self.cfg.rms_eps)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))

    def logits(self, x):  # [..., H] -> [..., V'] over the draft vocabulary
        return rms_norm(x, self.norm, self.cfg.rms_eps) @ self.lm_head.T

    def forward(self, target_features, features, input_ids, positions, past_key, past_value, bias):
        """target_features [B, S1, n*H] (committed tokens i: fused by ``fc``), features [B, S2, H] (draft tokens:
        the head's own earlier outputs), input_ids [B, S1+S2] (x[i+1]), positions [B, S1+S2], past K/V
        [B, P, kvh, hd], bias [B, 1, S, P+S] -> output [B, S, H], new key and value [B, S, kvh, hd]."""
        hidden = torch.cat([self.fuse(target_features), features], 1)  # [B, S, H]
        attn, k, v = attention(self, self.layer_input(hidden, input_ids), positions, past_key, past_value, bias)
        return self.finish(hidden, attn), k, v


class MedusaHeads(nn.Module):
    """K residual blocks on the target's feature; each block's LM-head logits predict a token further ahead."""

    def __init__(self, cfg: HeadConfig, target: FrozenTarget):
        super().__init__()
        self.cfg, self.target = cfg, target
        H, K = cfg.hidden_size, cfg.medusa_heads
        self.weight = nn.Parameter(torch.zeros(K, H, H))  # zero init: every head starts as the target's LM head
        self.bias = nn.Parameter(torch.zeros(K, 1, H))

    def forward(self, hidden):  # [R, H] -> per-head features [K, R, H]
        return hidden + nn.functional.silu(hidden @ self.weight + self.bias)
