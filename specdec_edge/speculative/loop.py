"""The one decode loop: prefill, then repeat propose -> verify -> accept -> commit/rollback -> emit.

Every method runs through ``decode``; plain decoding is the same loop with ``EmptyProposer``,
so speed comparisons are fair. State invariant between steps:

* ``context`` = prompt + every emitted token; its last token is *pending*;
* the target cache holds exactly ``context[:-1]`` (``target.length == len(context) - 1``).

With ``reuse``, the caches keep what the last call left (``Engine.held``): a call whose context shares a prefix
with it rolls the target back to that prefix (O(1)) and prefills only the rest, and each proposer keeps its own
state for what it can (``Proposer.prefill``'s ``kept``). ``Stats.reused_tokens`` counts the slots kept.

A step verifies ``[pending] + draft_tokens`` in one target pass (logits row i predicts the
token after input i), accepts ``n`` draft tokens plus the target's own next token, commits
the ``n + 1`` inputs whose K/V are now right (rejected slots are overwritten later: rollback
is free), and the new target token becomes the pending one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import Engine, prefill, replay  # noqa: F401 (prefill: its home for the proposers)
from specdec_edge.runtime.tree import is_chain, tree_inputs
from specdec_edge.sampling import SamplingParams, make_rng
from specdec_edge.speculative.acceptance import EXACT, AcceptanceRule
from specdec_edge.speculative.history_store import HistoryStore
from specdec_edge.speculative.proposal import EMPTY, Proposal, Proposer, subset
from specdec_edge.speculative.stats import Stats

log = logging.getLogger("specdec_edge")
GREEDY = SamplingParams()
NEAR_TIE = 1e-3  # greedy: a top-2 logit gap below this may flip between a k-token and a 1-token pass


@dataclass(frozen=True)
class Emitted:
    """What one step emits: the accepted tokens and the target's own, and why generation ended
    (None while it goes on)."""

    tokens: list[int]
    finish_reason: str | None = None  # "eos" | "length" | "cancelled"


@dataclass(frozen=True)
class Call:
    """What one call asks of the loop: how many tokens, how to sample, how deep to propose, what ends it, the rule
    that accepts, whether it reuses what the caches hold, and the history store it drafts from (None: none)."""

    max_new_tokens: int
    params: SamplingParams = GREEDY
    k: int = 4  # the deepest proposal a step may verify
    eos_ids: frozenset | set = frozenset()
    rule: AcceptanceRule = EXACT
    reuse: bool = False
    history: HistoryStore | None = None
    # A resumed call (``api/generation.py``): how many tokens at the end of its prompt (before the pending one) its
    # own decode passes wrote before it lost the engines; they are fed again by decode passes, not prefilled.
    decoded: int = 0


class Contexts(Protocol):
    """Where earlier contexts are kept (``api/engines.Engines``): before a reusing call, ``restore_best`` may make
    ``engine``'s caches hold the stored context that shares the most with ``context``; returns the tokens restored."""

    def restore_best(self, engine: Engine, context: list[int]) -> int: ...


def decode(
    target: Engine,
    proposer: Proposer,
    prompt: Sequence[int],
    call: Call | None = None,
    *,
    rng: np.random.Generator | None = None,
    stats: Stats | None = None,
    cancel: threading.Event | None = None,
    contexts: Contexts | None = None,
    **keywords,
) -> Iterator[Emitted]:
    """Generate up to ``call.max_new_tokens`` after ``prompt``, yielding the tokens of each step.

    ``call`` (or its fields as ``keywords``: ``max_new_tokens=8, k=4``) says what is asked (``Call``); ``rule``
    decides what is accepted (default: the exact rules; see ``acceptance.py``). ``reuse``: keep the prefix of
    ``prompt`` that the caches hold from earlier calls (module docstring) instead of prefilling it again;
    ``contexts``, asked first when reusing, may restore an earlier context into the caches
    (``api/prompt_cache.py``).

    Stops after an eos token (emitted, and nothing after it), at ``max_new_tokens`` (a
    proposal is cut to what is left), or when ``cancel`` is set; closing the generator
    also stops it. ``stats`` is filled in as the loop runs.
    """
    call = call if call is not None else Call(**keywords)
    max_new_tokens, params, k, eos_ids, rule = call.max_new_tokens, call.params, call.k, call.eos_ids, call.rule
    if not prompt:
        raise SpecdecError("the prompt is empty: give at least one token.")
    if max_new_tokens < 1:
        raise SpecdecError(f"max_new_tokens={max_new_tokens} is invalid: use a value >= 1.")
    stats = stats if stats is not None else Stats()
    rng = rng if rng is not None else make_rng(params.seed)
    context = [int(t) for t in prompt]
    stats.prompt_tokens = len(context)
    start = time.perf_counter()
    if call.reuse and contexts is not None:
        stats.restored_tokens = contexts.restore_best(target, context)
    kept = target.reusable(context[:-1]) if call.reuse else 0
    fill(target, context[:-1], kept, call.decoded)
    if call.history is not None:
        proposer.prefill(context, params, rng, kept if call.reuse else None, call.history)
    elif call.reuse:
        proposer.prefill(context, params, rng, kept)
    else:
        proposer.prefill(context, params, rng)  # (proposers outside the registry may take three arguments)
    stats.reused_tokens, stats.prefilled_tokens = kept, len(context) - 1 - kept
    stats.prefill_s = time.perf_counter() - start
    stats.total_s = stats.prefill_s

    while True:
        if cancel is not None and cancel.is_set():
            yield Emitted([], "cancelled")
            return
        left = max_new_tokens - stats.new_tokens
        t0 = time.perf_counter()
        proposal = fit(target, proposer.propose(context, min(k, left - 1)))
        t1 = time.perf_counter()
        logits, hidden = verify(target, context[-1], proposal)
        t2 = time.perf_counter()
        path, token = rule(proposal, logits, params, rng)  # path: accepted nodes, indices into the proposal
        n = len(path)
        proposer.observe(proposal, logits, hidden)
        emitted = [*map(int, proposal.tokens[path]), token] if n else [token]
        finish = None
        eos_at = next((i for i, t in enumerate(emitted) if t in eos_ids), None)
        if eos_at is not None:
            emitted, finish = emitted[: eos_at + 1], "eos"
        if len(emitted) >= left:
            emitted, finish = emitted[:left], finish or "length"
        # Keep the pending token + accepted drafts (slot 0 + 1 + path); the last emitted is pending now.
        target.commit(len(emitted), None if proposal.parents is None else np.concatenate([[0], path + 1]))
        context.extend(emitted)
        t3 = time.perf_counter()
        proposer.commit(context)
        t4 = time.perf_counter()
        if params.greedy:
            # the logits each emitted token came from: a chain's first rows, a tree's accepted nodes
            rows = range(len(emitted)) if proposal.parents is None else np.concatenate([[0], path + 1])[: len(emitted)]
            ties, gap = near_ties(logits, rows, emitted)  # greedy: each emitted token is its row's argmax
            if ties:
                stats.near_ties += ties
                stats.min_logit_gap = min(stats.min_logit_gap or gap, gap)
                log.info(
                    "near tie after %d new tokens: top-2 logit gap %.2e (greedy may differ from a one-token pass here)",
                    stats.new_tokens,
                    gap,
                )
        stats.steps += 1
        stats.proposed += len(proposal.tokens)
        stats.accepted += n
        stats.accepted_lengths[n] += 1
        stats.record(proposal.source, len(proposal.tokens), n)
        stats.new_tokens += len(emitted)
        stats.draft_s += (t1 - t0) + (t4 - t3)
        stats.verify_s += t2 - t1
        stats.total_s = t4 - start
        yield Emitted(emitted, finish)
        if finish is not None:
            return


def fill(target: Engine, tokens: list[int], kept: int, decoded: int = 0) -> None:
    """Commit ``tokens`` to the target after the ``kept`` slots it holds of them: by prefill, but the last
    ``decoded`` ones (a resumed call's own tokens, ``Call.decoded``) through decode passes again (``replay``):
    prefilled, their K/V could round unlike decoding's where the device's verdict says a prefill differs, and the
    rest of the answer with them."""
    decoded_from = max(kept, len(tokens) - min(decoded, len(tokens)))
    prefill(target, tokens[:decoded_from], kept=kept)
    replay(target, tokens[decoded_from:])


def fit(target: Engine, proposal: Proposal) -> Proposal:
    """``proposal`` cut so that its pass keeps plain decoding's rounding (``Engine.max_rows``: no key-count
    boundary inside it; nodes are parent-first, so a prefix is a tree) and fits in the cache (else no proposal)."""
    rows = target.max_rows()
    if rows is not None and 1 + len(proposal.tokens) > rows:
        proposal = subset(proposal, np.arange(rows - 1)) if rows > 1 else EMPTY
    if target.length + 1 + len(proposal.tokens) > target.capacity:
        proposal = EMPTY  # no room to verify a proposal this wide: a plain step
    return proposal


def verify(target: Engine, pending: int, proposal: Proposal) -> tuple[np.ndarray, np.ndarray | None]:
    """One target pass over ``[pending] + proposal.tokens``.

    Returns the logits ``[1+m, V]`` and, when the graph has them, the hidden states ``[1+m, H]``
    as the engine gave them (float32; its reused buffers: valid until the target's next run, which
    is the next step). A chain runs causally; a tree gets tree positions and an ancestor-only bias.
    """
    ids = (
        np.concatenate([[pending], np.asarray(proposal.tokens, dtype=np.int64)]) if len(proposal.tokens) else [pending]
    )
    if proposal.parents is None or is_chain(proposal.parents):  # (a chain-shaped tree's inputs are a chain's)
        out = target.run(ids)
    else:
        positions, bias = tree_inputs(np.concatenate([[-1], proposal.parents + 1]), target.length)
        out = target.run(ids, positions, bias)
    hidden = None if out.hidden_states is None else np.asarray(out.hidden_states, dtype=np.float32)
    return np.asarray(out.logits, dtype=np.float32), hidden


def near_ties(logits: np.ndarray, rows=None, tops=None) -> tuple[int, float]:
    """Of ``rows`` of ``logits`` (default: all), how many have top-2 logits closer than NEAR_TIE
    (greedy output may depend on batching there), and the smallest such gap. ``tops``: each row's argmax where
    the caller knows it (greedy decoding emitted it; one pass over the row fewer); a token that is not its row's
    argmax (a lossy rule accepted it) is found out by the masked max and the argmax computed.

    Runs once per step over a few rows of the vocabulary: argmax, then the max with the top entry
    masked in place and restored -- no vocabulary-sized copy (~10x cheaper than np.partition).
    """
    if logits.shape[-1] < 2:
        return 0, 0.0
    count, smallest = 0, np.inf
    for i, r in enumerate(range(len(logits)) if rows is None else rows):
        row = logits[r]
        gap = _top_gap(row, int(row.argmax()) if tops is None else int(tops[i]))
        if gap < 0:  # not the argmax
            gap = _top_gap(row, int(row.argmax()))
        if gap < NEAR_TIE:
            count, smallest = count + 1, min(smallest, gap)
    return count, (smallest if count else 0.0)


def _top_gap(row: np.ndarray, top: int) -> float:
    """row[top] minus the largest other entry (the top entry masked in place and restored)."""
    best = row[top]
    row[top] = -np.inf
    gap = float(best - row.max())
    row[top] = best
    return gap
