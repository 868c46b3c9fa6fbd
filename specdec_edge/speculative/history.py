"""Drafting from history: earlier calls' prompts and outputs, kept in a bounded store, for prompt lookup.

Prompt lookup (``lookup.py``) drafts from the current context only, while what an app or an agent sends
is full of what it saw in earlier calls: previous answers, code being edited, repeated tool output. A
``HistoryStore`` keeps the token streams of finished calls (prompt + output) and proposes the
continuation of the longest recent match of the current context's suffix:

* the tokens live in one int32 buffer, streams separated by ``SEP`` (a continuation never runs past
  the end of its stream); a call that extends the last stream (the next turn of a chat, whose prompt
  is the previous call's prompt + answer + a new message) appends only its new tokens;
* an index per n-gram length in ``LEVELS`` (a hashed pool, one slot per hash: a newer n-gram overwrites
  an older one with the same slot, so recent text wins) maps an n-gram to where it was last followed by
  something; a hit is checked against the stored tokens (a hash collision or an evicted span is a miss)
  and its length measured backwards, up to ``MAX_MATCH`` tokens;
* memory is bounded: the buffer and the index are numpy arrays sized once from the limit
  (``nbytes`` never exceeds it); when the buffer is full the oldest tokens go first. What recurs is
  added again with the call that repeats it, so it stays (least recently *seen* goes first).

Lookups cost a few hash probes per step (``benchmarks/history_lookup.py`` measures them), whatever
the store holds. Proposals are verified as every proposal is, so the output is unchanged (greedy:
the target's own tokens; sampling: its distribution); only speed depends on the history. A store is
one client's: drafts from a store shared by several clients would let one time how fast its text is
generated and so learn whether another sent it (docs/SERVING.md). Seeded sampling does not draft from
history (the text a seed gives must not depend on earlier calls). Pure numpy; thread-safe.
"""

from __future__ import annotations

from specdec_edge.errors import SpecdecError
from specdec_edge.speculative.history_store import (  # noqa: F401 (the store's names: their home for callers)
    DEFAULT_HISTORY_MB,
    LEVELS,
    MAX_HISTORY_MB,
    MAX_MATCH,
    MIN_TOKENS,
    SEP,
    HistoryStore,
    ngram_hash,
    ngram_hashes,
)
from specdec_edge.speculative.lookup import PromptLookupProposer, find_match, match_length
from specdec_edge.speculative.proposal import EMPTY, Proposal, Proposer


class HistoryProposer(Proposer):
    """Proposes from the history store only: ``auto``'s candidate (prompt lookup is a candidate of its own).

    ``matched`` is the length of the match behind the last proposal (0: none), ``auto``'s key for its rates.
    """

    def __init__(self, min_match: int = 4):
        if not 1 <= min_match <= MAX_MATCH:
            raise SpecdecError(f"history needs 1 <= min_match <= {MAX_MATCH}; got min_match={min_match}.")
        self.min_match = min_match
        self.store: HistoryStore | None = None  # the running call's (``prefill``'s ``history``)
        self.matched = 0

    def prefill(self, prompt, params, rng, kept=None, history=None) -> None:
        # Seeded sampling: the seed must pin the text, which drafts from earlier calls would change.
        # No state of its own follows the context (the store is the call's): a reused prefix changes nothing here.
        self.store = history if params.greedy or params.seed is None else None

    def propose(self, context, k) -> Proposal:
        self.matched = 0
        store = self.store
        if k <= 0 or store is None:
            return EMPTY
        tokens, self.matched = store.lookup(context, k, self.min_match)
        return Proposal(tokens, source="history") if len(tokens) else EMPTY


class HistoryLookupProposer(PromptLookupProposer):
    """Prompt lookup over this call's context and over the history store: the longer match proposes
    (the method ``history``; a tie goes to the context)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, min_match: int = 4):
        super().__init__(max_ngram, min_ngram)
        self.history = HistoryProposer(min_match)

    def prefill(self, prompt, params, rng, kept=None, history=None) -> None:
        super().prefill(prompt, params, rng, kept)  # the context's index keeps what it shares (prompt lookup's)
        self.history.prefill(prompt, params, rng, kept, history)

    def propose(self, context, k) -> Proposal:
        self.matched = 0
        if k <= 0:
            return EMPTY
        tokens = self.buf[: self.length]
        start, n = find_match(tokens, self.max_ngram, self.min_ngram)
        local = match_length(tokens, start, MAX_MATCH) if n else 0
        earlier = self.history.propose(context, k)
        if len(earlier.tokens) and self.history.matched > local:
            self.matched = self.history.matched
            return earlier
        self.matched = local
        return Proposal(tokens[start : start + k].copy(), source="pld") if n else EMPTY
