"""What each head's ONNX graph computes: the torch wrappers, and example inputs to check graphs against them.

Medusa's wrapper is traced into its graph; EAGLE's and EAGLE-3's graphs are built op by op
(``head_builder.py``) and checked against these wrappers.

A head graph returns the ``TOP_K`` best draft tokens per row (log-probabilities and
full-vocabulary ids) instead of the logits, so the host never handles a vocabulary-wide array.
The input/output names and dynamic axes are in the recipes (``head_recipes.py``);
docs/DESIGN.md has the table.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec_edge.export.head_modules import Eagle3Head, EagleHead, HeadConfig, MedusaHeads

TOP_K = 10  # candidates per row that a head graph returns


class EagleGraph(nn.Module):
    """EAGLE head step: predicted features, top-k of the rows in ``logit_rows``, and the new key and value."""

    def __init__(self, head: EagleHead):
        super().__init__()
        self.head = head

    def forward(self, features, input_ids, position_ids, past_key, past_value, attention_bias, logit_rows):
        head = self.head
        out, key, value = head(features, input_ids, position_ids, past_key, past_value, attention_bias)
        logp = head.target.logits(out[0].index_select(0, logit_rows)).log_softmax(-1)  # [R, V']
        values, idx = logp.topk(TOP_K, -1)  # [R, TOP_K]
        return out, values, head.target.vocab_ids[idx], key, value


class Eagle3Graph(nn.Module):
    """EAGLE-3 head step: its outputs, top-k of the rows in ``logit_rows``, and the new key and value.

    Committed tokens come as ``target_features`` (fused by the head), draft tokens as ``features``
    (the head's own earlier outputs); either may have zero rows."""

    def __init__(self, head: Eagle3Head):
        super().__init__()
        self.head = head

    def forward(
        self, target_features, features, input_ids, position_ids, past_key, past_value, attention_bias, logit_rows
    ):
        head = self.head
        out, key, value = head(target_features, features, input_ids, position_ids, past_key, past_value, attention_bias)
        logp = head.logits(out[0].index_select(0, logit_rows)).log_softmax(-1)  # [R, V']
        values, idx = logp.topk(TOP_K, -1)  # [R, TOP_K]
        return out, values, head.target.vocab_ids[idx], key, value


class MedusaGraph(nn.Module):
    """Medusa heads on R features: top-k per head and row."""

    def __init__(self, head: MedusaHeads):
        super().__init__()
        self.head = head

    def forward(self, hidden_states):  # [R, H]
        logp = self.head.target.logits(self.head(hidden_states)).log_softmax(-1)  # [K, R, V']
        values, idx = logp.topk(TOP_K, -1)  # [K, R, TOP_K]
        return values, self.head.target.vocab_ids[idx]


def _eagle_example(cfg: HeadConfig, past: int, seq: int, seed: int) -> tuple:
    """EagleGraph inputs: ``seq`` new rows after a random ``past``-row cache, causal among themselves."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.zeros(1, 1, seq, past + seq)
    bias[0, 0, :, past:] = torch.triu(torch.full((seq, seq), float("-inf")), 1)
    return (
        torch.randn(1, seq, cfg.hidden_size, generator=g),
        torch.randint(0, cfg.vocab_size, (1, seq), generator=g),
        torch.arange(past, past + seq)[None],
        torch.randn(1, past, cfg.num_kv_heads, cfg.head_dim, generator=g),
        torch.randn(1, past, cfg.num_kv_heads, cfg.head_dim, generator=g),
        bias,
        torch.tensor([seq - 1, 0]),
    )


def eagle_examples(cfg: HeadConfig) -> list[tuple]:
    """Two EagleGraph input sets of different sizes: the first is traced, both are validated."""
    return [_eagle_example(cfg, past=5, seq=3, seed=0), _eagle_example(cfg, past=9, seq=6, seed=1)]


def eagle3_examples(cfg: HeadConfig) -> list[tuple]:
    """Eagle3Graph inputs: committed rows then draft rows (traced with both); rows of one kind only, as at run time."""
    width = len(cfg.feature_layers) * cfg.hidden_size
    out = []
    for (past, seq, seed), committed in (((5, 3, 0), 2), ((9, 6, 1), 6), ((7, 4, 2), 0)):
        features, *rest = _eagle_example(cfg, past, seq, seed)
        g = torch.Generator().manual_seed(seed + 10)
        out.append((torch.randn(1, committed, width, generator=g), features[:, committed:], *rest))
    return out


def medusa_examples(cfg: HeadConfig) -> list[tuple]:
    """Two MedusaGraph input sets (3 and 5 rows): the first is traced, both are validated."""
    return [(torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(n)),) for n in (3, 5)]
