"""The EAGLE and EAGLE-3 heads at run time: their own small KV cache, and an EAGLE-2 style dynamic tree.

Head slot i reads ``(f[i], context[i+1])`` -- the target's feature of token i and the token
after it -- and predicts ``f[i+1]``; its own small KV cache holds the slots of the committed
context. Each step first feeds the new true features, then grows a tree: at each depth the
``topk`` most confident nodes (cumulative draft log-probability) are run through the head in
one pass with a tree mask, each gets ``topk`` children; finally the ``nodes`` best nodes form
the proposal. The tree is deterministic, so the loop verifies it exactly. Light: numpy and
onnxruntime only.

A chain (``topk`` 1) drafts greedily when the call is greedy; when it samples, each token is drawn from the head's
own distribution over its ``top_k`` best tokens at the call's temperature (top-k, top-p), and that distribution goes
with the proposal (``Proposal.probs``), so the exact rule accepts a token with probability min(1, p/q): a token the
head is unsure of still has a chance, where its single best guess is accepted only with the target's probability
of it (docs/lab/corpus-and-table.md, 2026-12-05).

EAGLE-3 (``Eagle3Proposer``) differs only in what a slot reads: committed slots the target's
layer features (``tap.layer_features``, fused inside the head graph), tree nodes their parent's
output, as EAGLE's tree nodes read their parent's predicted feature.

A call that reuses the caches keeps the head slots that read only what the target kept: slot i needs the feature
of token i and the tokens up to i+1 (``fed`` records them), so ``prefill`` keeps the slots below both the
target's kept prefix and the prefix ``fed`` shares with the new prompt, and the first step feeds the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import causal_bias, common_prefix
from specdec_edge.runtime.tree import path_to
from specdec_edge.sampling import SamplingParams, probs_from_logits, sample
from specdec_edge.speculative.features import FeatureTap
from specdec_edge.speculative.proposal import EMPTY, Proposal, Proposer

if TYPE_CHECKING:  # only for type hints: the head sessions live in runtime/
    from specdec_edge.runtime.head_graphs import HeadGraph


class EagleProposer(Proposer):
    """EAGLE head with its own KV cache; EAGLE-2 style dynamic tree by draft confidence."""

    source = "eagle"  # names its proposals in the stats

    def __init__(self, graph: HeadGraph, tap: FeatureTap, topk: int = 3, nodes: int = 5, depth: int | None = None):
        for name, value in (("topk", topk), ("nodes", nodes), ("depth", depth)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                raise SpecdecError(f"EAGLE option {name}={value!r} is invalid: use an integer.")
        if not 1 <= topk <= graph.top_k or nodes < 1 or (depth is not None and depth < 1):
            raise SpecdecError(
                f"EAGLE needs 1 <= topk <= {graph.top_k}, nodes >= 1 and depth >= 1; "
                f"got topk={topk}, nodes={nodes}, depth={depth}."
            )
        self.graph, self.tap, self.topk, self.nodes, self.depth = graph, tap, topk, nodes, depth
        self.branches = topk > 1 and nodes > 1  # topk 1: a chain of the head's best tokens
        c = graph.config
        capacity = tap.capacity + 1 + 64 * topk  # committed slots + the scratch slots of one tree
        self.keys = np.zeros((1, capacity, c["num_kv_heads"], c["head_dim"]), dtype=np.float32)  # BSNH
        self.values = np.zeros_like(self.keys)
        self.length = 0  # head slots 0..length-1 hold (f[i], context[i+1]) with true features
        self.fed: list[int] = []  # context[:length+1]: the tokens those slots read (empty while length is 0)
        self.params, self.rng = SamplingParams(), np.random.default_rng()  # the call's (``prefill``)

    def prefill(self, prompt, params, rng, kept=None, history=None) -> None:
        self.params, self.rng = params, rng
        if kept is None:
            self.length = 0
        else:
            self.length = max(min(self.length, kept, common_prefix(self.fed, prompt) - 1), 0)
        del self.fed[self.length + 1 if self.length else 0 :]

    def _committed(self, start: int, stop: int) -> dict:
        """Head graph inputs of committed slots start..stop-1: the target's features of those tokens."""
        return {"features": self.tap.features[start:stop]}

    def _drafted(self, features: np.ndarray) -> dict:
        """Head graph inputs of tree nodes: their parents' outputs [S, H]."""
        return {"features": features}

    def _run(self, features: dict, ids, positions, bias, rows):
        """One head pass; the new K/V land in slots past..past+S-1 (past = bias width - S)."""
        past = bias.shape[-1] - len(ids)
        hidden, logp, top, key, value = self.graph.run(
            **{name: np.ascontiguousarray(f[None], dtype=np.float32) for name, f in features.items()},
            input_ids=np.asarray(ids, np.int64)[None],
            position_ids=np.asarray(positions, np.int64)[None],
            past_key=self.keys[:, :past],
            past_value=self.values[:, :past],
            attention_bias=bias,
            logit_rows=np.asarray(rows, np.int64),
        )
        self.keys[:, past : past + len(ids)] = key  # contiguous prefix slices: nothing is copied to run
        self.values[:, past : past + len(ids)] = value
        return hidden[0], logp, top

    def propose(self, context, k) -> Proposal:
        n = len(context)
        if k <= 0 or n < 2 or self.tap.length != n - 1:
            return EMPTY
        # 1. Feed the true features not yet in the head cache: slots length..n-2 (at least the last one, whose
        # output the tree grows from: a reused context may have left every slot in the head cache).
        start = min(self.length, n - 2)
        hidden, logp, top = self._run(
            self._committed(start, n - 1),
            context[start + 1 : n],
            np.arange(start, n - 1),
            causal_bias(start, n - 1 - start),
            [n - 2 - start],
        )
        self.length = n - 1
        self.fed.extend(int(t) for t in context[len(self.fed) : n])
        # 2. Grow the tree from the last slot's output
        if self.topk == 1:
            return self._chain(n, k, hidden[-1:], logp[0], top[0])
        return self._tree(n, k, hidden[-1], logp[0], top[0])

    def _tree(self, n: int, k: int, feature: np.ndarray, logp: np.ndarray, top: np.ndarray) -> Proposal:
        """EAGLE-2's dynamic tree from the last true slot's output ``feature`` [H] and its ``topk`` best tokens."""
        # node = (token, parent, score, depth, input feature); expanded nodes get a slot.
        tokens, parents, scores, depths, feats = [], [], [], [], []

        def add_children(parent, depth, base, feat, lp, ids):
            for j in range(self.topk):
                tokens.append(int(ids[j]))
                parents.append(parent)
                scores.append(base + float(lp[j]))
                depths.append(depth)
                feats.append(feat)

        add_children(-1, 1, 0.0, feature, logp, top)
        slot = {}  # expanded node -> head slot
        for depth in range(1, min(k, self.depth or k)):
            level = [i for i in range(len(tokens)) if depths[i] == depth]
            chosen = sorted(level, key=lambda i: -scores[i])[: self.topk]
            past = self.length + len(slot)
            if past + len(chosen) > self.keys.shape[1]:
                break
            bias = np.full((1, 1, len(chosen), past + len(chosen)), -np.inf, dtype=np.float32)
            bias[0, 0, :, : self.length] = 0.0
            for r, node in enumerate(chosen):
                bias[0, 0, r, past + r] = 0.0
                bias[0, 0, r, [slot[a] for a in path_to(parents, node)[:-1]]] = 0.0  # its expanded ancestors
            out, lp, ids = self._run(
                self._drafted(np.stack([feats[i] for i in chosen])),
                [tokens[i] for i in chosen],
                [n - 2 + depth] * len(chosen),
                bias,
                np.arange(len(chosen)),
            )
            for r, node in enumerate(chosen):
                slot[node] = past + r
                add_children(node, depth + 1, scores[node], out[r], lp[r], ids[r])
        # 3. Keep the best nodes; a parent scores at least its child, so the kept set is a tree.
        order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i]))
        kept = set()
        for i in order:
            if len(kept) == self.nodes:
                break
            if parents[i] < 0 or parents[i] in kept:
                kept.add(i)
        kept = sorted(kept, key=lambda i: (depths[i], -scores[i]))
        index = {node: j for j, node in enumerate(kept)}
        return Proposal(
            np.array([tokens[i] for i in kept], dtype=np.int64),
            parents=np.array([index.get(parents[i], -1) for i in kept], dtype=np.int64),
            source=self.source,
            confidence=np.exp([scores[i] for i in kept]),  # the head's probability of each node's whole path
        )

    def _chain(self, n: int, k: int, feature: np.ndarray, logp: np.ndarray, top: np.ndarray) -> Proposal:
        """``topk`` 1: the tree is a chain of the head's best tokens (sampled ones when the call samples: module
        docstring), each fed back one row a pass (what the tree code grows for topk 1, without its bookkeeping).
        ``feature`` [1, H] is the last true slot's output; ``logp``/``top`` its best tokens' log-probabilities and
        ids."""
        levels = min(k, self.depth or k, self.nodes)
        # the distributions the tokens were drawn from, dense over the vocabulary (the exact rule reads them): one
        # array for the chain, filled row by row; None when greedy
        probs = None if self.params.greedy else np.zeros((max(levels, 1), self.tap.vocab_size))
        token, score = self._draw(logp, top, None if probs is None else probs[0])
        tokens, scores = [token], [score]
        for depth in range(1, levels):
            past = self.length + depth - 1  # the chain's earlier nodes fill slots length..past-1: all seen
            if past + 1 > self.keys.shape[1]:
                break
            bias = np.zeros((1, 1, 1, past + 1), dtype=np.float32)
            feature, lp, ids = self._run(self._drafted(feature), tokens[-1:], [n - 2 + depth], bias, [0])
            token, score = self._draw(lp[0], ids[0], None if probs is None else probs[depth])
            tokens.append(token)
            scores.append(scores[-1] + score)
        return Proposal(
            np.array(tokens, dtype=np.int64),
            None if probs is None else probs[: len(tokens)],
            parents=np.arange(-1, len(tokens) - 1, dtype=np.int64),
            source=self.source,
            confidence=np.exp(scores),
        )

    def _draw(self, logp: np.ndarray, top: np.ndarray, q: np.ndarray | None) -> tuple[int, float]:
        """One chain token from the head's best tokens ``top`` and their log-probabilities ``logp``, and the
        log-probability it is scored by: the first when greedy (``q`` None); else drawn from their distribution at
        the call's sampling settings, which is written into ``q`` (a zeroed row over the vocabulary)."""
        if q is None:
            return int(top[0]), float(logp[0])
        chance = probs_from_logits(np.asarray(logp, dtype=np.float64), self.params)  # over ``top``
        pick = sample(chance, self.rng)
        q[np.asarray(top, dtype=np.int64)] = chance
        return int(top[pick]), float(np.log(chance[pick]))


class Eagle3Proposer(EagleProposer):
    """EAGLE-3 head: committed slots read the target's layer features, tree nodes their parent's output."""

    source = "eagle3"

    def __init__(self, graph: HeadGraph, tap: FeatureTap, topk: int = 3, nodes: int = 5, depth: int | None = None):
        if tap.layer_features is None:
            raise SpecdecError(
                "the target graph has no layer_features output, which EAGLE-3 heads read; export the bundle "
                "with the EAGLE-3 heads (`export --heads`)."
            )
        if list(tap.graph.feature_layers) != list(graph.config["feature_layers"]):
            raise SpecdecError(
                f"the EAGLE-3 head reads target layers {graph.config['feature_layers']} but the target graph "
                f"outputs {list(tap.graph.feature_layers)}; export the bundle with these heads."
            )
        super().__init__(graph, tap, topk, nodes, depth)
        c = graph.config
        self._none = {
            "target_features": np.zeros((0, len(c["feature_layers"]) * c["hidden_size"]), np.float32),
            "features": np.zeros((0, c["hidden_size"]), np.float32),
        }

    def _committed(self, start: int, stop: int) -> dict:
        return {"target_features": self.tap.layer_features[start:stop], "features": self._none["features"]}

    def _drafted(self, features: np.ndarray) -> dict:
        return {"target_features": self._none["target_features"], "features": features}
