"""What a proposer hands the decode loop (``Proposal``), and the proposer contract (``Proposer``).

A proposer guesses the tokens that follow the context; the loop verifies the guess in one
target pass and keeps what the exact acceptance rule accepts. Every method is a proposer
(``speculative/methods.py`` lists them); plain decoding is the one that proposes nothing.

``Proposal.parents`` makes the tokens a tree: node i's parent among the proposal's nodes,
-1 for a child of the pending token, parents before children. ``None`` means a chain.
``Proposal.probs`` (q, chains only) is the distribution each token was drawn from, needed by
exact rejection sampling; ``None`` means the tokens were chosen deterministically.
``Proposal.source`` names the proposer that made it (per-proposer stats; ``""`` for no proposal), and
``Proposal.confidence``, when the proposer has one, is its own estimate of each node's chance of being
accepted (EAGLE's path probability, a draft model's), which ``auto`` calibrates against what the target
accepts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from specdec_edge.sampling import SamplingParams

if TYPE_CHECKING:
    from specdec_edge.speculative.history_store import HistoryStore


@dataclass(frozen=True)
class Proposal:
    tokens: np.ndarray  # [m] int64
    probs: np.ndarray | None = None  # [m, V] float64 (q), or None for deterministic tokens
    parents: np.ndarray | None = None  # [m] int64 tree parents, or None for a chain
    source: str = ""  # the proposer that made it ("pld", "eagle", ...); "" for no proposal
    confidence: np.ndarray | None = None  # [m] float: the proposer's estimate that each node is accepted


EMPTY = Proposal(np.zeros(0, dtype=np.int64))


def subset(proposal: Proposal, kept: np.ndarray) -> Proposal:
    """The proposal's nodes ``kept`` (parent-first: every node's parent comes before it), re-indexed."""
    kept = np.asarray(kept, dtype=np.int64)
    probs = None if proposal.probs is None else proposal.probs[kept]
    confidence = None if proposal.confidence is None else proposal.confidence[kept]
    if proposal.parents is None:  # a chain's prefix
        return Proposal(proposal.tokens[kept], probs, None, proposal.source, confidence)
    index = {int(node): j for j, node in enumerate(kept)}
    parents = np.array([index.get(int(proposal.parents[i]), -1) for i in kept], dtype=np.int64)
    return Proposal(proposal.tokens[kept], probs, parents, proposal.source, confidence)


class Proposer(ABC):
    """Proposes draft tokens for the decode loop and keeps whatever state it needs across steps.

    One generation calls ``prefill`` once, then per step ``propose`` -> (target pass) ->
    ``observe`` -> ``commit``. ``context`` is always prompt + every emitted token; its last
    token is the *pending* one, whose K/V the target has not committed yet. Only ``propose``
    is required; the other steps default to doing nothing.
    """

    # True when proposals can branch (siblings). Quantized targets verify only chain-shaped proposals bit for
    # bit (``GraphSpec.verdict.tree_invariant``); ``Pipeline`` checks this.
    branches: bool = False

    def prefill(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        rng: np.random.Generator,
        kept: int | None = None,
        history: HistoryStore | None = None,
    ) -> None:
        """Start a generation after ``prompt`` (its last token is pending).

        Args:
            prompt: the prompt's token ids.
            params: the sampling parameters of this generation (greedy or not, temperature, ...).
            rng: the generation's random generator (for proposers that sample their drafts).
            kept: None: start afresh. Else the call reuses what earlier calls left (``decode(reuse=True)``): the
                target's cache (and its feature tap) kept the first ``kept`` tokens of ``prompt``, and a proposer
                may keep its own state for the prefix of ``prompt`` it has recorded (state that reads the target's
                features for at most ``kept`` tokens). What it keeps may change its proposals (so speed, never the
                greedy output: verification is exact) but only as a function of the calls before: the same calls
                in the same order propose the same tokens.
            history: the store of earlier calls' text this call drafts from (``speculative/history.py``; the
                pipeline's, or the server's per API key), or None: none. Only the proposers that draft from
                history read it; the others pass it on or ignore it.
        """

    @abstractmethod
    def propose(self, context: Sequence[int], k: int) -> Proposal:
        """Draft tokens to verify after ``context``.

        Args:
            context: prompt + emitted tokens; the last one is pending.
            k: how far to propose: a chain of at most k tokens, a tree at most k deep (lookahead's
               Jacobi window keeps its own shape); 0 or less means propose nothing. The loop cuts
               emitted tokens to the length limit, so a deeper proposal is never wrong, only wasted.
        Returns:
            A ``Proposal`` (``EMPTY`` for none: the step becomes a plain one).
        """

    def observe(self, proposal: Proposal, logits: np.ndarray, hidden: np.ndarray | None = None) -> None:
        """See the target's verdict on the proposal the loop verified (it may be ``EMPTY``).

        Args:
            proposal: what was verified this step (not always the last ``propose`` result: the loop
                verifies ``EMPTY`` when the cache has no room).
            logits: [1+m, V] target logits for [pending] + proposal tokens.
            hidden: [1+m, H] target hidden states, when the graph outputs them.
        """

    def commit(self, context: Sequence[int]) -> None:
        """The context after acceptance (it grew by the accepted tokens and the target's own): drop
        what was rejected."""

    def claim(self, owner: Hashable) -> None:
        """The next calls are ``owner``'s (the server passes its API key's; told before every call, whoever's it is).
        A proposer that learns from the calls it runs (acceptance models, an n-gram pool)
        must not let one owner's text shape another's proposals (their speed would tell it): it keeps what it
        learned per owner, or forgets it. Stateless proposers do nothing."""
