"""Model-free and draft-model proposers: plain decoding (no proposal) and a separate draft model.

The protocol they follow is in ``speculative/proposal.py``.
"""

from __future__ import annotations

import numpy as np

from specdec_edge.runtime.base import Engine
from specdec_edge.sampling import SamplingParams, probs_from_logits, sample
from specdec_edge.speculative.loop import prefill
from specdec_edge.speculative.proposal import EMPTY, Proposal, Proposer


class EmptyProposer(Proposer):
    """Proposes nothing: the loop becomes plain autoregressive decoding."""

    def propose(self, context, k) -> Proposal:
        return EMPTY


class DraftModelProposer(Proposer):
    """A smaller model with the target's tokenizer, run k times with S=1 per proposal.

    Invariant: the draft cache holds ``self.seen``, a prefix of ``context[:-1]`` (plus, between
    ``propose`` and ``commit``, the proposed tokens it has fed). ``propose`` first feeds the
    context tokens the draft has not seen -- the pending token, and after a fully accepted
    proposal also the last draft token, which was never fed -- then drafts; ``commit`` rolls
    the cache back to the longest prefix of ``seen`` that the accepted context confirms.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.seen: list[int] = []
        self.confirmed = 0  # seen[:confirmed] is known to be a prefix of the context
        self.params = SamplingParams()
        self.rng = np.random.default_rng()

    def prefill(self, prompt, params, rng, kept=None, history=None) -> None:
        self.params, self.rng = params, rng
        self.seen = [int(t) for t in prompt[:-1]]
        self.confirmed = len(self.seen)
        # reuse: the draft's own cache keeps the prefix it holds (its own record, not the target's)
        prefill(self.engine, self.seen, kept=0 if kept is None else self.engine.reusable(self.seen))

    def propose(self, context, k) -> Proposal:
        if k <= 0:
            return EMPTY
        feed = [int(t) for t in context[len(self.seen) :]]
        self.confirmed = len(context)
        tokens, probs, confidence, path = [], [], [], 1.0
        for _ in range(k):
            logits = self.engine.run(feed, logits_to_keep=1).logits[-1]
            self.engine.commit(len(feed))
            self.seen.extend(feed)
            token, q, p = self._draw(logits)
            tokens.append(token)
            probs.append(q)
            path *= p
            confidence.append(path)
            feed = [token]
        return Proposal(
            np.array(tokens, dtype=np.int64),
            None if self.params.greedy else np.stack(probs),
            source="draft",
            confidence=np.array(confidence),
        )

    def _draw(self, logits: np.ndarray) -> tuple[int, np.ndarray | None, float]:
        """The draft token, the distribution it was drawn from (None: greedy) and the draft's probability of it."""
        if self.params.greedy:
            token = int(np.argmax(logits))
            shifted = logits - logits[token]
            return token, None, float(1.0 / np.exp(shifted, dtype=np.float64).sum())
        q = probs_from_logits(logits, self.params)
        token = sample(q, self.rng)
        return token, q, float(q[token])

    def commit(self, context) -> None:
        limit = min(len(self.seen), len(context) - 1)  # the pending token must be fed at the next propose
        n = min(self.confirmed, limit)
        while n < limit and self.seen[n] == context[n]:
            n += 1
        self.engine.rollback(n)
        del self.seen[n:]
        self.confirmed = n


class FirstOfProposer(Proposer):
    """``first``'s proposal when it has one, else ``second``'s (e.g. prompt lookup, else EAGLE).

    Both see every step (prefill, observe, commit), so either can take over at any step; each
    step is verified and accepted by the exact rules, whichever proposed it.
    """

    def __init__(self, first: Proposer, second: Proposer):
        self.first, self.second = first, second
        self.branches = first.branches or second.branches

    def prefill(self, prompt, params, rng, kept=None, history=None) -> None:
        self.first.prefill(prompt, params, rng, kept, history)
        self.second.prefill(prompt, params, rng, kept, history)

    def propose(self, context, k) -> Proposal:
        proposal = self.first.propose(context, k)
        if len(proposal.tokens):
            return proposal
        return self.second.propose(context, k)

    def observe(self, proposal: Proposal, logits: np.ndarray, hidden: np.ndarray | None = None) -> None:
        self.first.observe(proposal, logits, hidden)
        self.second.observe(proposal, logits, hidden)

    def commit(self, context) -> None:
        self.first.commit(context)
        self.second.commit(context)

    def claim(self, owner) -> None:
        self.first.claim(owner)
        self.second.claim(owner)
