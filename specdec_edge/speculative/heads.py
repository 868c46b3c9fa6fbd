"""Trained self-drafting at run time: EAGLE (dynamic tree) and Medusa (static tree) proposers.

Both read the target's own hidden states. ``FeatureTap`` wraps the target engine and keeps
the feature of every committed cache slot (prefill chunks and accepted tree paths alike),
so after any step ``tap.features[i]`` is the target's final-norm hidden state of
``context[i]`` for every ``i < tap.length``. The pending token has no feature yet.

* Medusa: head d on the last feature ``f[n-2]`` scores the token at depth d after the
  pending one; a static tree of rank paths (``(0, 1)`` = head 1's best, then head 2's
  second best) becomes the proposal.
* EAGLE: head slot i reads ``(f[i], context[i+1])`` and predicts ``f[i+1]``; its own small
  KV cache holds the slots of the committed context. Each step first feeds the new true
  features, then grows a tree EAGLE-2 style: at each depth the ``topk`` most confident nodes
  (cumulative draft log-probability) are run through the head in one pass with a tree mask,
  each gets ``topk`` children; finally the ``nodes`` best nodes form the proposal.

Trees are deterministic, so the loop verifies them exactly: greedy output equals plain
greedy and sampling keeps the target's distribution (recursive rejection over siblings).
Light: numpy and onnxruntime only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import causal_bias
from specdec_edge.runtime.ort_engine import session_options
from specdec_edge.speculative.proposal import EMPTY, Proposal, Proposer
from specdec_edge.speculative.tree import path_to

# Rank paths of the default Medusa tree: depth 1..5, most likely first (21 nodes).
MEDUSA_TREE = (
    (0,), (1,), (2,), (3,), (4,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 3),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 2),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0),
    (0, 0, 0, 0, 0),
)


class FeatureTap:
    """The target engine, plus ``features[i]``: the hidden state of committed cache slot i."""

    def __init__(self, engine):
        if not engine.graph.has_hidden_states:
            raise SpecdecError("the target graph has no hidden_states output, which draft heads read; "
                               "re-export the bundle with --hidden-states (or with --heads).")
        self.engine = engine
        self.features = np.zeros((engine.capacity, engine.graph.hidden_size), dtype=np.float32)
        self._hidden = None

    def __getattr__(self, name):  # capacity, length, rollback, graph, ... of the engine
        return getattr(self.engine, name)

    def reset(self) -> None:
        self.engine.reset()

    def run(self, input_ids, position_ids=None, attention_bias=None, logits_to_keep=None):
        out = self.engine.run(input_ids, position_ids, attention_bias, logits_to_keep)
        self._hidden = out.hidden_states  # valid until the next run; commit comes first
        return out

    def commit(self, n: int, path=None) -> None:
        rows = np.arange(n) if path is None else np.asarray(path, dtype=np.int64)[:n]
        start = self.engine.length
        self.features[start : start + n] = self._hidden[rows]
        self.engine.commit(n, path)


class HeadGraph:
    """One head graph of a bundle in its own ONNX Runtime session."""

    def __init__(self, path: Path, section: dict, threads: int | None = None):
        self.session = ort.InferenceSession(str(path), sess_options=session_options(threads, share_process=True),
                                            providers=["CPUExecutionProvider"])
        self.config = section["config"]
        self.top_k = int(section["top_k"])
        self.defaults = dict(section.get("tree", {}))  # tree settings the bundle was measured with

    def run(self, **inputs) -> list[np.ndarray]:
        return self.session.run(None, inputs)


def load_head_graphs(root: Path, heads: dict | None, threads: int | None = None) -> dict:
    """``{"eagle": HeadGraph, "medusa": HeadGraph}`` for the heads a bundle's manifest lists."""
    return {m: HeadGraph(Path(root) / s["graph"], s, threads) for m, s in (heads or {}).items() if m != "default"}


class MedusaProposer(Proposer):
    """A static tree of rank paths over the Medusa heads' top-k tokens."""

    def __init__(self, graph: HeadGraph, tap: FeatureTap, tree=None):
        self.graph, self.tap = graph, tap
        depth_max = graph.config["medusa_heads"]
        tree = tree or [p for p in MEDUSA_TREE if len(p) <= depth_max]
        paths = sorted(dict.fromkeys(tuple(int(r) for r in p) for p in tree), key=len)  # stable: parents first
        for p in paths:
            if not p or len(p) > depth_max or max(p) >= graph.top_k or min(p) < 0:
                raise SpecdecError(f"Medusa tree path {p} is invalid: depth 1..{depth_max}, ranks 0..{graph.top_k - 1}.")
            if len(p) > 1 and p[:-1] not in paths:
                raise SpecdecError(f"Medusa tree path {p} has no parent path {p[:-1]}; list every prefix.")
        self.paths = paths

    def propose(self, context, k) -> Proposal:
        if k <= 0 or self.tap.length == 0:
            return EMPTY
        _, ids = self.graph.run(hidden_states=self.tap.features[self.tap.length - 1 : self.tap.length])  # [K, 1, T]
        paths = [p for p in self.paths if len(p) <= k]
        index = {p: i for i, p in enumerate(paths)}
        tokens = np.array([ids[len(p) - 1, 0, p[-1]] for p in paths], dtype=np.int64)
        parents = np.array([index[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=np.int64)
        return Proposal(tokens, parents=parents)


class EagleProposer(Proposer):
    """EAGLE head with its own KV cache; EAGLE-2 style dynamic tree by draft confidence."""

    def __init__(self, graph: HeadGraph, tap: FeatureTap, topk: int = 3, nodes: int = 5, depth: int | None = None):
        for name, value in (("topk", topk), ("nodes", nodes), ("depth", depth)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                raise SpecdecError(f"EAGLE option {name}={value!r} is invalid: use an integer.")
        if not 1 <= topk <= graph.top_k or nodes < 1 or (depth is not None and depth < 1):
            raise SpecdecError(f"EAGLE needs 1 <= topk <= {graph.top_k}, nodes >= 1 and depth >= 1; "
                               f"got topk={topk}, nodes={nodes}, depth={depth}.")
        self.graph, self.tap, self.topk, self.nodes, self.depth = graph, tap, topk, nodes, depth
        c = graph.config
        capacity = tap.capacity + 1 + 64 * topk  # committed slots + the scratch slots of one tree
        self.keys = np.zeros((1, capacity, c["num_kv_heads"], c["head_dim"]), dtype=np.float32)  # BSNH
        self.values = np.zeros_like(self.keys)
        self.length = 0  # head slots 0..length-1 hold (f[i], context[i+1]) with true features

    def prefill(self, prompt, params, rng) -> None:
        self.length = 0

    def _run(self, features, ids, positions, bias, rows):
        """One head pass; the new K/V land in slots past..past+S-1 (past = bias width - S)."""
        past = bias.shape[-1] - len(ids)
        hidden, logp, top, key, value = self.graph.run(
            features=np.ascontiguousarray(features[None], dtype=np.float32), input_ids=np.asarray(ids, np.int64)[None],
            position_ids=np.asarray(positions, np.int64)[None], past_key=self.keys[:, :past],
            past_value=self.values[:, :past], attention_bias=bias, logit_rows=np.asarray(rows, np.int64))
        self.keys[:, past : past + len(ids)] = key  # contiguous prefix slices: nothing is copied to run
        self.values[:, past : past + len(ids)] = value
        return hidden[0], logp, top

    def propose(self, context, k) -> Proposal:
        n = len(context)
        if k <= 0 or n < 2 or self.tap.length != n - 1:
            return EMPTY
        # 1. Feed the true features not yet in the head cache: slots length..n-2.
        start = self.length
        hidden, logp, top = self._run(self.tap.features[start : n - 1], context[start + 1 : n], np.arange(start, n - 1),
                                      causal_bias(start, n - 1 - start), [n - 2 - start])
        self.length = n - 1
        # 2. Grow the tree: node = (token, parent, score, depth, input feature); expanded nodes get a slot.
        tokens, parents, scores, depths, feats = [], [], [], [], []

        def add_children(parent, depth, base, feat, lp, ids):
            for j in range(self.topk):
                tokens.append(int(ids[j]))
                parents.append(parent)
                scores.append(base + float(lp[j]))
                depths.append(depth)
                feats.append(feat)

        add_children(-1, 1, 0.0, hidden[-1], logp[0], top[0])
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
            out, lp, ids = self._run(np.stack([feats[i] for i in chosen]), [tokens[i] for i in chosen],
                                     [n - 2 + depth] * len(chosen), bias, np.arange(len(chosen)))
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
        return Proposal(np.array([tokens[i] for i in kept], dtype=np.int64),
                        parents=np.array([index.get(parents[i], -1) for i in kept], dtype=np.int64))
