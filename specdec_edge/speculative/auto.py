"""``auto``: each step, the proposer, width and tree that promise the most tokens per second on this device.

Every step, for each proposer the bundle can run (prompt lookup, EAGLE or Medusa heads, a draft
model, lookahead) and for plain decoding (width 0), ``auto`` prices the options:

    value = (1 + expected accepted tokens) / (proposers' time + verify time of width w + 1 + overhead)

* the verify time comes from the device's measured cost curve (``costs.py``), scaled by how fast
  the passes actually run now;
* the expected accepted tokens of the first w nodes (parent-first, most likely first) come from
  each proposer's online acceptance model (``predictors.py``);
* a proposer's own time is measured as it runs; a costly one (a head) is only asked when its
  recent proposals could beat the best option already in hand, and only one level deeper than its
  options have lately been worth (``depth_to_ask``).

It verifies the best option through the exact rules, as every method does: the choice changes
speed, never the output (greedy output equals plain's token for token; sampling keeps the
target's distribution). Sampling with a seed follows a fixed rule instead, which reads no measured time and nothing
an earlier call taught (``_fixed_proposal``: the candidate this call's own verdicts favour, one level past what it
has lately been worth in this call), so that the seed pins the text as with any fixed method.

Three safety nets: every proposer is verified now and then even when its model says no (a probe,
rarer each time it fails), and a node one past the best prefix is verified while its key is untried (a node
priced just below its row would otherwise never be learned), so a model cannot stay wrong; and a guard watches
the real throughput of the last ``GUARD_WINDOW`` steps: when it falls below what plain decoding would give,
``auto`` runs plain steps for a while (longer after each relapse) and then tries again.
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specdec_edge.speculative.costs import CostModel
from specdec_edge.speculative.predictors import Predictor, chain_parents, prefix_order
from specdec_edge.speculative.proposal import EMPTY, Proposal, Proposer, subset

PROBE_EVERY = 32  # steps: a proposer not verified for this long is verified once (doubling while probes fail)
PROBE_MAX = 1024
GUARD_WINDOW = 32  # steps of measured throughput the guard compares with plain decoding
PLAIN_BACKOFF = (16, 512)  # plain steps after the guard trips: first, and the most after repeated trips
EMA = 0.2  # weight of a new measurement in running means
CHEAP = 0.05  # a proposer costing less than this share of a 1-row pass is always asked
FIXED_WINDOW = 4  # seeded sampling's rule: a candidate's last proposals in this call that set its depth
FIXED_CALLS = 16  # seeded sampling's records kept for calls that may resume (``AutoProposer.prefill``)
# Seeded sampling: a candidate whose proposals in this whole call were accepted fewer than FIXED_FLOOR tokens each
# is not asked, so that the step is plain, except on every FIXED_PROBE-th plain step in a row. A drafted token costs
# a verify row (~8 % of a pass on an AVX-512 CPU) and a head's run (~5 %): at temperature 1.5, 3 % accepted, asking
# every step ran at 0.84x plain (2026-12-05). The rate starts from FIXED_PRIOR proposals of half a token each (ten
# rejected in a row put a candidate below), and counts the whole call, not its last FIXED_WINDOW proposals: where 60 %
# of first drafts are rejected (temperature 0.7), a floor read from a few proposals idled the head for whole calls.
FIXED_FLOOR = 0.15
FIXED_PRIOR = 4
FIXED_PROBE = 8
# What auto learns from the calls it runs, kept per owner (``AutoProposer.claim``): per candidate, and its own.
LEARNED_PER_CANDIDATE = ("predictor", "cost_s", "gain", "width", "asked", "chosen", "probe_every")
LEARNED = ("slowdown", "overhead", "step", "window", "plain_until", "backoff")


@dataclass
class Candidate:
    """One proposer ``auto`` may choose, with its acceptance model and what it has measured."""

    name: str
    proposer: Proposer
    predictor: Predictor
    cost_s: float = 0.0  # running mean of its propose + commit seconds
    gain: float = 1.0  # running mean of the expected accepted tokens of its best option when asked
    width: float = 1.0  # running mean of that option's width
    asked: int = -(10**9)  # step it was last asked to propose
    chosen: int = 0  # step it was last verified (starts "recent": priors decide first)
    probe_every: int = PROBE_EVERY
    # Seeded sampling (``AutoProposer._fixed_proposal``): its proposal cut to this many nodes (None: no cut beyond
    # the rule's depth); False leaves it out then.
    fixed_width: int | None = None
    fixed: bool = True


@dataclass
class _FixedCall:
    """Seeded sampling's record of one call: each candidate's accepted tokens per proposal (its last FIXED_WINDOW),
    its proposals and accepted tokens in the whole call, and how many plain steps in a row the rule has taken since
    it last asked a candidate."""

    accepted: dict[str, deque]
    totals: dict[str, list[int]] = field(default_factory=dict)  # name -> [proposals, accepted tokens]
    plain_steps: int = 0


@dataclass
class _Option:
    gain: float  # expected accepted tokens
    width: int  # nodes verified
    candidate: Candidate | None = None  # None: plain (for a merged tree: its first part's candidate)
    proposal: Proposal = EMPTY
    # Each proposer's share: (candidate, its predictor's keys, their nodes in ``proposal``), for the verdicts.
    parts: list = field(default_factory=list)
    probe: bool = False
    whole: tuple | None = None  # (proposal, rates, keys) before truncation: what a merged tree is built from


class AutoProposer(Proposer):
    """Chooses among ``candidates`` (and plain) every step by expected tokens per second (module docstring)."""

    def __init__(self, candidates: list[Candidate], costs: CostModel, trees: bool = True):
        self.candidates = candidates
        self.costs = costs
        self.trees = trees  # proposals may branch: two proposers' drafts may be verified as one tree
        self.branches = any(c.proposer.branches for c in candidates)
        self.slowdown = 1.0  # measured verify time / the cost model's
        self.overhead = 0.0  # seconds per step outside proposers and verification (acceptance, bookkeeping)
        self.step = 0
        self.window: deque = deque(maxlen=GUARD_WINDOW)  # (tokens, seconds) of recent steps
        self.plain_until = 0  # the guard's plain steps run until this step
        self.backoff = PLAIN_BACKOFF[0]
        self.fixed = False  # seeded sampling: a fixed rule instead of measured choices (``prefill``)
        self._call = _FixedCall({})  # seeded sampling: this call's record (``_fixed_proposal``)
        self._calls: dict[int, tuple] = {}  # id(rng) -> (rng, its call's ``_FixedCall``): the latest FIXED_CALLS
        self._chosen: _Option | None = None
        self._returned: Proposal | None = None
        self._times = (0.0, 0.0, 0.0)  # step start, end of propose, proposers' seconds
        self.owner = None  # whose calls taught what it holds (``claim``)
        self._fresh = copy.deepcopy(self._learned())  # what a new owner starts from: the priors
        self._owners: dict = {}  # what other owners' calls taught, set aside

    # ---- the Proposer protocol

    def prefill(self, prompt, params, rng, kept=None, history=None) -> None:
        for c in self.candidates:
            c.proposer.prefill(prompt, params, rng, kept, history)
        self.window.clear()
        self.plain_until = 0
        self._chosen = None
        # Sampling with a seed: the seed must pin the text, so no choice may depend on a measured time or on
        # what earlier generations taught the models. A fixed rule instead (``_fixed_proposal``), which reads what
        # this call accepted so far: a call that goes on after another used the engines (``api/generation.py``)
        # prefills again with its own rng, and finds its record by it (held here, so its id names no other rng).
        self.fixed = not params.greedy and params.seed is not None
        if self.fixed:
            rng_of, self._call = self._calls.pop(id(rng), (None, None))
            if rng_of is not rng:
                self._call = _FixedCall({c.name: deque(maxlen=FIXED_WINDOW) for c in self.candidates})
            self._calls[id(rng)] = (rng, self._call)  # the latest last
            while len(self._calls) > FIXED_CALLS:
                del self._calls[next(iter(self._calls))]

    def claim(self, owner) -> None:
        """Learn per owner: the acceptance models, proposer timings and the guard's window one owner's calls built
        are set aside, and ``owner``'s own (or the priors) come back, so that no owner's text changes how fast
        another's calls run (the server's owners are its API keys; docs/SERVING.md)."""
        for c in self.candidates:
            c.proposer.claim(owner)
        if owner == self.owner:
            return
        self._owners[self.owner] = self._learned()
        self.owner = owner
        candidates, own = self._owners.pop(owner, None) or copy.deepcopy(self._fresh)
        for c, learned in zip(self.candidates, candidates):
            for name, value in learned.items():
                setattr(c, name, value)
        for name, value in own.items():
            setattr(self, name, value)

    def _learned(self) -> tuple[list[dict], dict]:
        return (
            [{name: getattr(c, name) for name in LEARNED_PER_CANDIDATE} for c in self.candidates],
            {name: getattr(self, name) for name in LEARNED},
        )

    def propose(self, context, k) -> Proposal:
        start = time.perf_counter()
        self.step += 1
        self._base = len(context)
        if k <= 0 or self.step < self.plain_until:
            option, sunk = _Option(0.0, 0), 0.0
        elif self.fixed:
            option, sunk = self._fixed_proposal(context, k), 0.0
        else:
            option, sunk = self._choose(context, k)
        self._chosen = option
        self._returned = option.proposal
        self._times = (start, time.perf_counter(), sunk)
        return option.proposal

    def observe(self, proposal: Proposal, logits: np.ndarray, hidden: np.ndarray | None = None) -> None:
        self._verified_s = time.perf_counter() - self._times[1]
        if proposal is not self._returned:  # the loop verified something else (no room left in the cache)
            self._chosen = None
        for c in self.candidates:
            c.proposer.observe(proposal, logits, hidden)

    def commit(self, context) -> None:
        for c in self.candidates:
            c.proposer.commit(context)
        option, emitted = self._chosen, list(context[self._base :])
        if option is None:
            return
        if option.candidate is not None:
            accepted = accepted_nodes(option.proposal, emitted)
            parents = chain_parents(option.proposal)
            reached = (parents < 0) | accepted[np.maximum(parents, 0)]  # the node's parent was accepted
            for c, keys, nodes in option.parts:
                c.predictor.update(keys, accepted[nodes], reached[nodes])
            if self.fixed:
                tokens = int(accepted.sum())
                self._call.accepted[option.candidate.name].append(tokens)
                totals = self._call.totals.setdefault(option.candidate.name, [0, 0])
                totals[0], totals[1] = totals[0] + 1, totals[1] + tokens
            if option.probe:
                c = option.candidate
                c.probe_every = PROBE_EVERY if accepted.any() else min(2 * c.probe_every, PROBE_MAX)
        start, proposed, sunk = self._times
        seconds = time.perf_counter() - start
        modeled = self.costs.verify(option.width + 1, self._base)
        self.slowdown += EMA * (self._verified_s / max(modeled, 1e-9) - self.slowdown)
        self.overhead += EMA * (max(seconds - sunk - self._verified_s, 0.0) - self.overhead)
        if self.fixed or self.step < self.plain_until:
            return  # seeded sampling must not depend on timing; the guard's own plain steps are not judged
        self.window.append((len(emitted), seconds))
        self._guard(len(context))

    # ---- choosing

    def verify_s(self, width: int, context: int) -> float:
        """Expected seconds of verifying ``width`` draft nodes (a pass of width + 1 rows) plus the step's overhead."""
        return self.costs.verify(width + 1, context) * self.slowdown + self.overhead

    def _choose(self, context, k: int) -> tuple[_Option, float]:
        n = len(context)
        options = [_Option(0.0, 0)]
        sunk = 0.0

        def value(gain, width, extra=0.0):
            return (1.0 + gain) / (sunk + extra + self.verify_s(width, n))

        for c in sorted(self.candidates, key=lambda c: c.cost_s):
            best = max(options, key=lambda o: value(o.gain, o.width))
            cheap = c.cost_s < CHEAP * self.verify_s(0, n)
            due = self.step - c.asked >= c.probe_every
            if not (cheap or due) and value(c.gain, c.width, c.cost_s) <= value(best.gain, best.width, c.cost_s):
                continue
            t0 = time.perf_counter()
            proposal = c.proposer.propose(context, k if cheap else depth_to_ask(c, k))
            spent = time.perf_counter() - t0
            sunk += spent
            c.cost_s += EMA * (spent - c.cost_s)
            c.asked = self.step
            if not len(proposal.tokens):
                c.gain += EMA * (0.0 - c.gain)
                continue
            option = self._best_prefix(c, proposal, lambda g, w: value(g, w))
            c.gain += EMA * (option.gain - c.gain)
            c.width += EMA * (option.width - c.width)
            option.probe = self.step - c.chosen >= c.probe_every
            options.append(option)
        if self.trees:  # the two best proposals as one tree: more chances in one pass where width is cheap
            mergeable = [o for o in options if o.whole is not None and o.proposal.probs is None]
            if len(mergeable) >= 2:
                top = sorted(mergeable, key=lambda o: -value(o.gain, o.width))[:2]
                options.append(merged_option(top, lambda g, w: value(g, w)))
        probes = [o for o in options if o.probe]
        if probes:  # the candidate verified longest ago first
            chosen = min(probes, key=lambda o: o.candidate.chosen)
        else:
            chosen = max(options, key=lambda o: value(o.gain, o.width))
        for c, _, _ in chosen.parts:
            c.chosen = self.step
            if not chosen.probe:
                c.probe_every = PROBE_EVERY
        return chosen, sunk

    def _fixed_proposal(self, context, k: int) -> _Option:
        """Seeded sampling's rule, so that the same seed gives the same text: nothing measured in time, nothing an
        earlier call taught; only this call's own verdicts, which the seed pins. The candidates are asked best first
        by the tokens this call accepted per proposal of theirs (an untried one counts half a token, so each is
        tried early; ties in the candidates' order), the first that proposes is verified: one level deeper than its
        proposals have lately been worth in this call (``depth_to_ask``'s rule; one token at first, a row that costs
        nothing where one-row passes are padded to two; a tree that deep), cut to its ``fixed_width`` nodes. A
        candidate below FIXED_FLOOR is not asked but on every FIXED_PROBE-th plain step in a row: where nothing is
        accepted, the steps are plain. The rule it replaced, the first candidate's whole k-token proposal, ran
        seeded sampling at 0.77x plain decoding's speed on an AVX2 CPU (prompt lookup and the n-gram table's
        guesses, 5-14 % accepted at temperature 0.7)."""
        probe = self._call.plain_steps >= FIXED_PROBE - 1
        fixed = [c for c in self.candidates if c.fixed]
        for c in sorted(fixed, key=lambda c: -self._fixed_rate(c)):
            proposals, accepted = self._call.totals.get(c.name, (0, 0))
            if (accepted + 0.5 * FIXED_PRIOR) / (proposals + FIXED_PRIOR) < FIXED_FLOOR and not probe:
                continue
            recent = self._call.accepted[c.name]
            depth = level_past(sum(recent) / len(recent) if recent else 0.0, k)
            proposal = c.proposer.propose(context, depth)  # a chain of at most ``depth``; a tree that deep
            if len(proposal.tokens):
                if c.fixed_width is not None and c.fixed_width < len(proposal.tokens):
                    proposal = subset(proposal, np.arange(c.fixed_width))  # node order is parent-first
                self._call.plain_steps = 0
                return _Option(0.0, len(proposal.tokens), c, proposal, [(c, [], np.zeros(0, np.int64))])
        self._call.plain_steps += 1
        return _Option(0.0, 0)

    def _fixed_rate(self, c: Candidate) -> float:
        """Tokens accepted per proposal of ``c`` in this call's recent steps, with half a token for an untried one."""
        recent = self._call.accepted[c.name]
        return (sum(recent) + 0.5) / (len(recent) + 1)

    def _best_prefix(self, c: Candidate, proposal: Proposal, value) -> _Option:
        """The most valuable parent-first prefix of ``proposal`` (all of it when its predictor says so)."""
        rates, keys = c.predictor.rates(proposal, c.proposer)
        order = prefix_order(proposal, rates)
        gains = np.cumsum(rates[order])
        widths = range(1, len(order) + 1) if c.predictor.truncatable else [len(order)]
        width = max(widths, key=lambda w: value(gains[w - 1], w))
        if width < len(order) and c.predictor.truncatable and c.predictor.untried(keys[order[width]]):
            # one node past the best prefix whose rate was never judged: without it a node priced just below its
            # row is never verified, so never learned (prompt lookup stayed 1 deep for a whole process on an AVX2
            # CPU where 2.3 paid: 1.31x against 1.40x its plain)
            width += 1
        whole = (proposal, rates, keys) if c.predictor.truncatable else None
        if width == len(order) and np.array_equal(order, np.arange(len(order))):
            return _Option(float(gains[-1]), width, c, proposal, [(c, keys, order)], whole=whole)
        kept = order[:width]
        part = (c, [keys[i] for i in kept], np.arange(width))
        return _Option(float(gains[width - 1]), width, c, subset(proposal, kept), [part], whole=whole)

    # ---- the guard

    def plain_rate(self, context: int) -> float:
        """Tokens per second plain decoding would give now (a 1-row pass, scaled to how fast passes run)."""
        return 1.0 / (self.costs.verify(1, context) * self.slowdown + self.overhead)

    def _guard(self, context: int) -> None:
        if len(self.window) < GUARD_WINDOW:
            return
        tokens = sum(t for t, _ in self.window)
        seconds = sum(s for _, s in self.window)
        if tokens / seconds < self.plain_rate(context):
            self.plain_until = self.step + self.backoff
            self.backoff = min(2 * self.backoff, PLAIN_BACKOFF[1])
            self.window.clear()
        elif self.step >= self.plain_until + GUARD_WINDOW:
            self.backoff = PLAIN_BACKOFF[0]  # a whole window at or above plain since the last trip


def depth_to_ask(c: Candidate, k: int) -> int:
    """How deep to ask a costly proposer (a head or a draft model runs once per level): one level past the width
    its options have been worth lately, rounded to the nearest level, so that it grows a level at a time where
    acceptance allows (a width that keeps reaching 1.5 asks a third level), instead of running ``k`` levels a step
    when one or two are verified (a 4-deep EAGLE chain cost 4x the head step that the ~1.3 verified nodes needed).
    Rounded, not ceiled: an EAGLE head worth 1.1 nodes was asked three levels deep, two of them run for nothing on
    most steps; asking two cut its head runs by 30 % and made `auto` 1.03-1.04x faster on an AVX2 CPU
    (docs/lab/corpus-and-table.md, 2026-12-05)."""
    return level_past(c.width, k)


def level_past(worth: float, k: int) -> int:
    """One level past ``worth`` nodes, rounded half up, between 1 and ``k`` (``depth_to_ask``; seeded sampling's
    rule reads it from this call's accepted tokens)."""
    return max(1, min(k, math.floor(worth + 0.5) + 1))


def merged_option(options: list[_Option], value) -> _Option:
    """The whole proposals of ``options`` merged into one token tree (shared prefixes once), cut to its most
    valuable parent-first prefix. A node's acceptance probability is the same event whoever proposed it;
    where two proposers propose the same path, the likelier estimate is kept."""
    tokens, parents, rates, index, parts = [], [], [], {}, []
    for option in options:
        proposal, node_rates, keys = option.whole
        mapped = np.zeros(len(proposal.tokens), dtype=np.int64)
        own_parents = chain_parents(proposal)
        for i in prefix_order(proposal, node_rates):
            parent = int(own_parents[i])
            at = (-1 if parent < 0 else int(mapped[parent]), int(proposal.tokens[i]))
            node = index.get(at)
            if node is None:
                node = index[at] = len(tokens)
                tokens.append(at[1])
                parents.append(at[0])
                rates.append(float(node_rates[i]))
            else:
                rates[node] = max(rates[node], float(node_rates[i]))
            mapped[i] = node
        parts.append((option.candidate, keys, mapped))
    names = "+".join(o.candidate.name for o in options)
    tree = Proposal(np.array(tokens, dtype=np.int64), parents=np.array(parents, dtype=np.int64), source=names)
    rates = np.array(rates)
    order = prefix_order(tree, rates)
    gains = np.cumsum(rates[order])
    width = max(range(1, len(order) + 1), key=lambda w: value(gains[w - 1], w))
    kept = order[:width]
    position = np.full(len(tokens), -1, dtype=np.int64)
    position[kept] = np.arange(width)
    cut = []
    for c, keys, mapped in parts:
        inside = position[mapped] >= 0
        cut.append((c, [k for k, ok in zip(keys, inside) if ok], position[mapped][inside]))
    return _Option(float(gains[width - 1]), width, options[0].candidate, subset(tree, kept), cut)


def accepted_nodes(proposal: Proposal, emitted) -> np.ndarray:
    """Which nodes of a verified proposal were accepted, read from the tokens the step emitted.

    The accepted nodes form the longest root-down path whose tokens start ``emitted``: the token after
    them is the target's own, which differs from every sibling it was tested against.
    """
    m = len(proposal.tokens)
    accepted = np.zeros(m, dtype=bool)
    if proposal.parents is None:
        for i in range(min(m, len(emitted))):
            if proposal.tokens[i] != emitted[i]:
                break
            accepted[i] = True
        return accepted
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(proposal.parents.tolist()):
        children.setdefault(parent, []).append(i)

    def longest(node: int, depth: int) -> list[int]:
        best: list[int] = []
        if depth < len(emitted):
            for child in children.get(node, []):
                if proposal.tokens[child] == emitted[depth]:
                    path = [child, *longest(child, depth + 1)]
                    if len(path) > len(best):
                        best = path
        return best

    accepted[longest(-1, 0)] = True
    return accepted
