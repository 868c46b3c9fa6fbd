"""Training losses of the draft heads, as in the papers; each returns (loss, draft top-1 agreement).

A loss takes the head, a batch of sequences (``ids`` [T] and the target's ``features`` [T, H]
of prompt + answer, from ``draft_data.generate_data``) and ``batch_tokens``: a sequence longer
than that keeps its end, where the answer is.

* EAGLE: smooth-L1 regression of the next feature plus 0.1 x cross-entropy of the LM head on
  the predicted feature against the target's distribution.
* Medusa: cross-entropy of head i against the token i+2 places ahead, weighted 0.8^i.
"""

from __future__ import annotations

import torch

from specdec_edge.export.head_modules import EagleHead, MedusaHeads

IGNORE = -100  # label of a token outside the draft vocabulary (cross_entropy's ignore_index)


def eagle_loss(head: EagleHead, seqs: list[dict], batch_tokens: int):
    """Packed sequences, block-causal: (loss, draft top-1 agreement with the target)."""
    feats, ids, pos, blocks = [], [], [], []
    for d in seqs:
        f = torch.as_tensor(d["features"][-batch_tokens:]).float()  # [T, H]
        x = torch.as_tensor(d["ids"][-batch_tokens:])  # [T]
        feats.append(f)
        ids.append(x)
        pos.append(torch.arange(len(x) - 1))
        blocks.append(len(x) - 1)
    f_in = torch.cat([f[:-1] for f in feats])  # [N, H] f[i]
    f_next = torch.cat([f[1:] for f in feats])  # [N, H] f[i+1]
    x_in = torch.cat([x[1:] for x in ids])  # [N] x[i+1]
    mask = torch.block_diag(*[torch.tril(torch.ones(n, n, dtype=torch.bool)) for n in blocks])
    bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[None, None]  # [1, 1, N, N]
    cfg = head.cfg
    empty = torch.zeros(1, 0, cfg.num_kv_heads, cfg.head_dim)
    pred, _, _ = head(f_in[None], x_in[None], torch.cat(pos)[None], empty, empty, bias)
    pred = pred[0]  # [N, H]
    logp = head.target.logits(pred).log_softmax(-1)  # [N, V']
    with torch.no_grad():
        p = head.target.logits(f_next).softmax(-1)
    regression = torch.nn.functional.smooth_l1_loss(pred, f_next)
    classification = -(p * logp).sum(-1).mean()
    agree = (logp.argmax(-1) == p.argmax(-1)).float().mean().item()
    return regression + 0.1 * classification, agree


def _draft_rows(head: MedusaHeads) -> torch.Tensor:
    """[V]: each target token's row in the draft vocabulary, ``IGNORE`` for tokens outside it."""
    index = torch.full((head.cfg.vocab_size,), IGNORE, dtype=torch.long)
    index[head.target.vocab_ids] = torch.arange(len(head.target.vocab_ids))
    return index


def medusa_loss(head: MedusaHeads, seqs: list[dict], batch_tokens: int):
    """Head i on f[t] against token t+2+i (ignored where it is outside the draft vocabulary)."""
    K = head.cfg.medusa_heads
    index = _draft_rows(head)
    feats, labels = [], []
    for d in seqs:
        f = torch.as_tensor(d["features"][-batch_tokens:]).float()  # [T, H]
        x = index[torch.as_tensor(d["ids"][-batch_tokens:])]  # [T] draft rows
        lab = torch.full((K, len(x)), IGNORE, dtype=torch.long)
        for i in range(K):
            lab[i, : max(len(x) - 2 - i, 0)] = x[2 + i :]
        feats.append(f)
        labels.append(lab)
    logits = head.target.logits(head(torch.cat(feats)))  # [K, R, V']
    labels = torch.cat(labels, 1)  # [K, R]
    losses = torch.stack(
        [torch.nn.functional.cross_entropy(logits[i], labels[i], ignore_index=IGNORE) for i in range(K)]
    )
    loss = (losses.nan_to_num() * 0.8 ** torch.arange(K)).sum()
    valid = labels[0] >= 0
    agree = (logits[0].argmax(-1)[valid] == labels[0][valid]).float().mean().item() if valid.any() else 0.0
    return loss, agree
