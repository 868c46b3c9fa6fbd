"""Training losses of the draft heads, as in the papers; each returns (loss, draft top-1 agreement).

A loss takes the head, a batch of sequences (``ids`` [T] and the target's ``features`` [T, H]
of prompt + answer, from ``draft_data.generate_data``) and ``batch_tokens``: a sequence longer
than that keeps its end, where the answer is.

* EAGLE: smooth-L1 regression of the next feature plus 0.1 x cross-entropy of the LM head on
  the predicted feature against the target's distribution.
* EAGLE-3: training-time test. The head runs ``ttt_steps`` steps: step 0 reads the fused target
  features of token i, step s its own step s-1 output, each beside the true token x[i+1+s], and is
  scored by cross-entropy against the target's distribution of the token after that one,
  weighted 0.8^s (as in the EAGLE-3 paper; reported as KL divergence, the same gradient). Step s
  at slot i attends to step 0 at slots <= i (the committed context) and to steps 1..s at slot i
  (its own draft ancestors): the masks of the run-time draft tree.
* Medusa: cross-entropy of head i against the token i+2 places ahead, weighted 0.8^i.
"""

from __future__ import annotations

import torch

from specdec_edge.export.head_modules import Eagle3Head, EagleHead, MedusaHeads, rotate

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


def eagle3_loss(head: Eagle3Head, seqs: list[dict], batch_tokens: int):
    """Packed sequences, ``ttt_steps`` unrolled draft steps: (loss, draft top-1 agreement at step 0)."""
    cfg, steps = head.cfg, head.cfg.ttt_steps
    index = _draft_rows(head)
    g, f, ids, pos, blocks = [], [], [], [], []
    for d in seqs:
        x = torch.as_tensor(d["ids"][-batch_tokens:])  # [T]
        T = len(x)
        g.append(torch.as_tensor(d["layer_features"][-batch_tokens:][: T - 1]).float())  # slots i = 0..T-2
        # Per step s and slot i: the input token x[i+1+s], the target's feature f[i+1+s] (whose LM-head
        # distribution is the label) and the token x[i+2+s] the target chose (is there a label).
        ahead = torch.arange(T - 1)[None] + torch.arange(steps)[:, None] + 1  # [steps, T-1]: i+1+s
        inside = ahead + 1 <= T - 1
        f.append(torch.as_tensor(d["features"][-batch_tokens:]).float()[ahead.clamp(max=T - 1)])  # [steps, T-1, H]
        label = torch.where(inside, index[x[(ahead + 1).clamp(max=T - 1)]], IGNORE)
        ids.append(torch.stack([x[ahead.clamp(max=T - 1)], label]))
        pos.append(torch.arange(T - 1))
        blocks.append(T - 1)
    g, f, ids, pos = torch.cat(g), torch.cat(f, 1), torch.cat(ids, 2), torch.cat(pos)  # [N, nH], [steps, N, H]...
    tokens, labels = ids  # [steps, N] each
    N, nh, kvh, hd = len(pos), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    mask = torch.block_diag(*[torch.tril(torch.ones(n, n, dtype=torch.bool)) for n in blocks])
    bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))  # [N, N] step 0: block-causal
    hidden = head.fc(g)  # [N, H]
    keys, values, loss, agree = [], [], 0.0, 0.0
    for s in range(steps):
        h = head.layer_input(hidden, tokens[s])  # [N, 2H]
        q = rotate(head.q_proj(h).view(1, N, nh, hd).transpose(1, 2), (pos + s)[None], cfg.rope_theta)  # [1, nh, N, hd]
        k = rotate(head.k_proj(h).view(1, N, kvh, hd).transpose(1, 2), (pos + s)[None], cfg.rope_theta)
        v = head.v_proj(h).view(1, N, kvh, hd).transpose(1, 2)  # [1, kvh, N, hd]
        keys.append(k.repeat_interleave(nh // kvh, 1))
        values.append(v.repeat_interleave(nh // kvh, 1))
        scores = [q @ keys[0].transpose(-1, -2) * hd**-0.5 + bias]  # [1, nh, N, N]: the committed context
        scores += [(q * kt).sum(-1, keepdim=True) * hd**-0.5 for kt in keys[1:]]  # [1, nh, N, 1]: own ancestors
        attn = torch.cat(scores, -1).softmax(-1)
        out = attn[..., :N] @ values[0] + sum(attn[..., N + t : N + t + 1] * values[1 + t] for t in range(s))
        hidden = head.finish(hidden, out.transpose(1, 2).reshape(N, nh * hd))  # [N, H]
        logp = head.logits(hidden).log_softmax(-1)  # [N, V']
        with torch.no_grad():
            logp_target = head.target.logits(f[s]).log_softmax(-1)  # the target's, over the draft vocabulary
            p = logp_target.exp()
        valid = labels[s] != IGNORE
        if valid.any():  # KL(target || head): cross-entropy less the target's entropy, so 0 is a perfect head
            loss = loss + 0.8**s * (p[valid] * (logp_target[valid] - logp[valid])).sum(-1).mean()
        if s == 0:
            agree = (logp.argmax(-1)[valid] == p.argmax(-1)[valid]).float().mean().item() if valid.any() else 0.0
    return loss, agree


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
