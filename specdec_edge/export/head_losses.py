"""Training losses of the draft heads, as in the papers; each returns (loss, draft top-1 agreement).

A loss takes the head, a batch of sequences (``ids`` [T] and the target's ``features`` [T, H]
of prompt + answer, from ``draft_data.generate_data``) and ``batch_tokens``: a sequence longer
than that keeps its end, where the answer is.

* EAGLE: smooth-L1 regression of the next feature plus 0.1 x cross-entropy of the LM head on
  the predicted feature against the target's distribution. With ``ttt_steps`` > 1 (``train-draft --ttt-steps``)
  the answer's slots also run the deeper draft steps on the head's own predictions, as EAGLE-3 does (HASS's
  idea for EAGLE-2): the features depth 2+ drafting actually reads, not only the target's.
* EAGLE-3: training-time test. The head runs ``ttt_steps`` steps: step 0 reads the fused target
  features of token i, step s its own step s-1 output, each beside the true token x[i+1+s], and is
  scored by cross-entropy against the target's distribution of the token after that one,
  weighted 0.8^s (as in the EAGLE-3 paper; reported as KL divergence, the same gradient). Step s
  at slot i attends to step 0 at slots <= i (the committed context) and to steps 1..s at slot i
  (its own draft ancestors): the masks of the run-time draft tree. Step 0 is scored at every slot,
  as EAGLE's loss is; the deeper steps from the slot before the answer on (the reference
  repository's loss mask covers the answers).
* Medusa: cross-entropy of head i against the token i+2 places ahead, weighted 0.8^i.
"""

from __future__ import annotations

import torch

from specdec_edge.export.head_modules import Eagle3Head, EagleHead, MedusaHeads, rotate

IGNORE = -100  # label of a token outside the draft vocabulary (cross_entropy's ignore_index)


def eagle_loss(head: EagleHead, seqs: list[dict], batch_tokens: int):
    """Packed sequences, block-causal: (loss, draft top-1 agreement with the target). With ``cfg.ttt_steps`` > 1
    the head also runs that many draft steps on its own predictions (``eagle_unrolled_loss``)."""
    if head.cfg.ttt_steps > 1:
        return eagle_unrolled_loss(head, seqs, batch_tokens)
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
    return _eagle_step_loss(pred[0], f_next, head)


def _eagle_step_loss(pred, f_next, head):
    """EAGLE's loss of predicted features ``pred`` [R, H] against the target's ``f_next`` [R, H]: smooth-L1 plus
    0.1 x cross-entropy of the LM head's distributions; and the top-1 agreement."""
    logp = head.target.logits(pred).log_softmax(-1)  # [R, V']
    with torch.no_grad():
        p = head.target.logits(f_next).softmax(-1)
    regression = torch.nn.functional.smooth_l1_loss(pred, f_next)
    agree = (logp.argmax(-1) == p.argmax(-1)).float().mean().item()
    return regression + 0.1 * -(p * logp).sum(-1).mean(), agree


def eagle_unrolled_loss(head: EagleHead, seqs: list[dict], batch_tokens: int):
    """EAGLE with a training-time test (as HASS does for EAGLE-2, and as EAGLE-3's loss does): ``eagle_unroll``'s
    steps, step s weighted 0.8^s. (loss, step 0's top-1 agreement)."""
    loss, agree = 0.0, 0.0
    for s, (pred, f_label, valid) in enumerate(eagle_unroll(head, seqs, batch_tokens)):
        if valid.any():
            step_loss, step_agree = _eagle_step_loss(pred[valid], f_label[valid], head)
            loss = loss + 0.8**s * step_loss
            agree = step_agree if s == 0 else agree
    return loss, agree


def eagle_unroll(head: EagleHead, seqs: list[dict], batch_tokens: int):
    """Yield per draft step s: the head's predicted features [R_s, H], the target's features they are scored
    against [R_s, H], and which rows lie inside their sequence [R_s].

    Step 0 is ``eagle_loss``'s teacher-forced pass over every slot (slot i reads f[i] and x[i+1], predicts f[i+1]).
    Step s (1 .. ttt_steps-1) runs the answer's slots again on the head's own step s-1 prediction, as drafting at
    depth s+1 does: at slot i it reads (its prediction of f[i+s], x[i+1+s]) at position i+s and predicts f[i+1+s].
    It attends to step 0's keys of its sequence up to slot i (the committed context, true features) and to its own
    earlier steps at slot i (its draft ancestors): the run-time head cache and tree mask."""
    cfg, steps = head.cfg, max(head.cfg.ttt_steps, 1)
    f_in, f_next, x_in, pos, seq, q_row, q_ahead, q_valid = [], [], [], [], [], [], [], []
    keys = 0
    for b, d in enumerate(seqs):
        f = torch.as_tensor(d["features"][-batch_tokens:]).float()  # [T, H]
        x = torch.as_tensor(d["ids"][-batch_tokens:])  # [T]
        T = len(x)
        start = answer_start(d, T)
        f_in.append(f[:-1])
        f_next.append(f[1:])  # row of slot i: f[i+1]
        x_in.append(x[1:])  # row of slot i: x[i+1]
        pos.append(torch.arange(T - 1))
        seq.append(torch.full((T - 1,), b))
        slots = torch.arange(start - 1, T - 1)  # the answer's query slots
        ahead = slots[None] + torch.arange(steps)[:, None]  # [steps, m]: step s at slot i reads row i + s
        q_row.append(keys + slots)
        q_ahead.append(keys + ahead.clamp(max=T - 2))
        q_valid.append(ahead <= T - 2)  # x[i+1+s] and f[i+1+s] inside the sequence
        keys += T - 1
    f_in, f_next, x_in, pos, seq = map(torch.cat, (f_in, f_next, x_in, pos, seq))
    q_row, q_ahead, q_valid = torch.cat(q_row), torch.cat(q_ahead, 1), torch.cat(q_valid, 1)
    N, M = len(x_in), len(q_row)
    seen = (seq[None] == seq[:, None]) & (pos[None] <= pos[:, None])  # [N, N] block-causal
    bias = torch.zeros(N, N).masked_fill(~seen, float("-inf"))
    empty = torch.zeros(1, 0, cfg.num_kv_heads, cfg.head_dim)
    pred, past_k, past_v = head(f_in[None], x_in[None], pos[None], empty, empty, bias[None, None])
    yield pred[0], f_next, torch.ones(N, dtype=torch.bool)
    own = torch.full((M, M), float("-inf")).fill_diagonal_(0.0)  # a step's row sees its own slot's earlier steps
    bias, hidden = bias[q_row], pred[0][q_row]
    for s in range(1, steps):
        bias = torch.cat([bias, own], 1)  # [M, N + s*M]: the context, then steps 1..s at the same slot
        ids, positions = x_in[q_ahead[s]][None], (pos[q_row] + s)[None]
        out, k, v = head(hidden[None], ids, positions, past_k, past_v, bias[None, None])
        yield out[0], f_next[q_ahead[s]], q_valid[s]
        past_k, past_v, hidden = torch.cat([past_k, k], 1), torch.cat([past_v, v], 1), out[0]


def answer_top1(head: torch.nn.Module, seqs: list[dict], batch_tokens: int) -> tuple[int, int]:
    """(slots agreeing, slots) of the first draft step's top-1 with the target's over the answers' slots only: slot
    i >= answer start - 1, the slots drafting reads at run time (the losses' agreement also counts the prompts'
    slots, where a fixed system prompt is easy). EAGLE and EAGLE-3 heads; (0, 0) for others."""
    if isinstance(head, Eagle3Head):
        logp, target_logp, valid = next(eagle3_unroll(head, seqs, batch_tokens))
        agree = logp.argmax(-1) == target_logp.argmax(-1)
    elif isinstance(head, EagleHead):
        pred, f_next, valid = next(eagle_unroll(head, seqs, batch_tokens))
        agree = head.target.logits(pred).argmax(-1) == head.target.logits(f_next).argmax(-1)
    else:
        return 0, 0
    answers = torch.cat([_answer_slots(d, batch_tokens) for d in seqs]) & valid
    return int(agree[answers].sum()), int(answers.sum())


def _answer_slots(d: dict, batch_tokens: int) -> torch.Tensor:
    """[T-1] bool over a sequence's slots as the losses pack it (its last ``batch_tokens`` tokens): the answer's."""
    T = min(len(d["ids"]), batch_tokens)
    return torch.arange(T - 1) >= answer_start(d, T) - 1


def answer_start(d: dict, T: int) -> int:
    """The index of the answer's first token in the last ``T`` tokens of sequence ``d`` (kept within 1..T-1)."""
    return min(max(d["answer_start"] - (len(d["ids"]) - T), 1), T - 1)


def eagle3_loss(head: Eagle3Head, seqs: list[dict], batch_tokens: int):
    """Packed sequences, ``ttt_steps`` unrolled draft steps: (loss, draft top-1 agreement at step 0)."""
    loss, agree = 0.0, 0.0
    for s, (logp, target_logp, valid) in enumerate(eagle3_unroll(head, seqs, batch_tokens)):
        if valid.any():  # KL(target || head): cross-entropy less the target's entropy, so 0 is a perfect head
            lt, lp = target_logp[valid], logp[valid]
            loss = loss + 0.8**s * (lt.exp() * (lt - lp)).sum(-1).mean()
            if s == 0:
                agree = (lp.argmax(-1) == lt.argmax(-1)).float().mean().item()
    return loss, agree


def eagle3_unroll(head: Eagle3Head, seqs: list[dict], batch_tokens: int):
    """Yield per draft step s: the head's log-probs [M_s, V'] at its query slots, the target's [M_s, V'] and
    which rows have a label [M_s] (see ``eagle3_loss``).

    Step 0 queries every slot of every sequence (prompt and answer, as EAGLE's loss does: the more rows,
    the better the first draft token, which every accepted token goes through). The deeper steps query
    the slots from the one before the answer on, where drafting happens at run time; they cost as many
    head passes again each, which keeps them affordable on a CPU. Rows: sequence by sequence, slot by slot.
    """
    cfg, steps = head.cfg, head.cfg.ttt_steps
    index = _draft_rows(head)
    nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g, key_ids, key_pos, key_seq, f_next, labels0 = [], [], [], [], [], []  # per slot i (all): ..., f[i+1], label
    q_row, q_ids, q_labels, q_feature = [], [], [], []  # per answer slot: its row, then per step s >= 1
    keys = 0  # rows so far
    for b, d in enumerate(seqs):
        x = torch.as_tensor(d["ids"][-batch_tokens:])  # [T]
        T = len(x)
        start = answer_start(d, T)
        g.append(torch.as_tensor(d["layer_features"][-batch_tokens:][: T - 1]).float())  # slots 0..T-2
        f_next.append(torch.as_tensor(d["features"][-batch_tokens:][1:T]).float())  # f[i+1]: the label's source
        key_ids.append(x[1:])
        key_pos.append(torch.arange(T - 1))
        key_seq.append(torch.full((T - 1,), b))
        labels0.append(torch.cat([index[x[2:]], torch.tensor([IGNORE])]))  # x[i+2]; none for the last slot
        slots = torch.arange(start - 1, T - 1)  # [m] the answer's query slots
        # Per step s and answer slot i: the input token x[i+1+s], the target's feature f[i+1+s] (whose LM-head
        # distribution is the label: row keys + i + s) and the token x[i+2+s] the target chose (is there a label).
        ahead = (slots[None] + torch.arange(steps)[:, None] + 1).clamp(max=T - 1)  # [steps, m]
        inside = slots[None] + torch.arange(steps)[:, None] + 2 <= T - 1
        q_row.append(keys + slots)
        q_ids.append(x[ahead])
        q_labels.append(torch.where(inside, index[x[(ahead + 1).clamp(max=T - 1)]], IGNORE))
        q_feature.append(keys + ahead - 1)
        keys += T - 1
    g, key_ids, key_pos, key_seq = torch.cat(g), torch.cat(key_ids), torch.cat(key_pos), torch.cat(key_seq)
    q_row, labels0 = torch.cat(q_row), torch.cat(labels0)  # [M], [N]
    q_ids, q_labels, q_feature = torch.cat(q_ids, 1), torch.cat(q_labels, 1), torch.cat(q_feature, 1)  # [steps, M]
    M, N = len(q_row), len(key_ids)
    f_next = torch.cat(f_next)  # [N, H]
    with torch.no_grad():  # the target's distributions over the draft vocabulary, once per row
        target_logp = head.target.logits(f_next).log_softmax(-1)  # [N, V']
    # Step 0: every slot reads the fused target features of its token, causally within its sequence.
    hidden0 = head.fuse(g)  # [N, H]
    h0 = head.layer_input(hidden0, key_ids)  # [N, 2H]
    k0 = rotate(head.k_proj(h0).view(1, N, kvh, hd).transpose(1, 2), key_pos[None], cfg.rope_theta)
    k0 = k0.repeat_interleave(nh // kvh, 1)  # [1, nh, N, hd]
    v0 = head.v_proj(h0).view(1, N, kvh, hd).transpose(1, 2).repeat_interleave(nh // kvh, 1)
    q0 = rotate(head.q_proj(h0).view(1, N, nh, hd).transpose(1, 2), key_pos[None], cfg.rope_theta)
    seen = (key_seq[None] == key_seq[:, None]) & (key_pos[None] <= key_pos[:, None])  # [N, N] block-causal
    bias = torch.zeros(N, N).masked_fill(~seen, float("-inf"))
    attn = (q0 @ k0.transpose(-1, -2) * hd**-0.5 + bias).softmax(-1) @ v0  # [1, nh, N, hd]
    out0 = head.finish(hidden0, attn.transpose(1, 2).reshape(N, nh * hd))  # [N, H]
    yield head.logits(out0).log_softmax(-1), target_logp, labels0 != IGNORE
    # Steps 1..: the answer's slots, each reading its own previous output; keys: the committed slots <= i
    # (step 0's) and its own ancestors at this slot (steps 1..s).
    hidden, bias, own_k, own_v = out0[q_row], bias[q_row], [], []
    for s in range(1, steps):
        h = head.layer_input(hidden, q_ids[s])  # [M, 2H]
        pos = (key_pos[q_row] + s)[None]
        q = rotate(head.q_proj(h).view(1, M, nh, hd).transpose(1, 2), pos, cfg.rope_theta)
        k = rotate(head.k_proj(h).view(1, M, kvh, hd).transpose(1, 2), pos, cfg.rope_theta)
        own_k.append(k.repeat_interleave(nh // kvh, 1))  # [1, nh, M, hd]
        own_v.append(head.v_proj(h).view(1, M, kvh, hd).transpose(1, 2).repeat_interleave(nh // kvh, 1))
        scores = [q @ k0.transpose(-1, -2) * hd**-0.5 + bias]  # [1, nh, M, N]: the committed context
        scores += [(q * kt).sum(-1, keepdim=True) * hd**-0.5 for kt in own_k]  # [1, nh, M, 1]: own ancestors
        attn = torch.cat(scores, -1).softmax(-1)
        out = attn[..., :N] @ v0 + sum(attn[..., N + t : N + t + 1] * vt for t, vt in enumerate(own_v))
        hidden = head.finish(hidden, out.transpose(1, 2).reshape(M, nh * hd))  # [M, H]
        yield head.logits(hidden).log_softmax(-1), target_logp[q_feature[s]], q_labels[s] != IGNORE


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
