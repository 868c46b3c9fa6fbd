"""One EAGLE / EAGLE-3 head step: the traced graph (torch.onnx, before issue 36) against the built one, interleaved.

Usage:
  python benchmarks/head_step.py BUNDLE --heads specdec_edge/data/heads/eagle [--per-category 2] [--rounds 600]

BUNDLE gives the target (its ``hidden_states``; for EAGLE-3 its ``layer_features`` of the head's layers) and its
weights; both graphs are written from the heads folder into a scratch folder, each with its own fp16 embedding copy.
Prints:
* time of one step (seq 1 and 4 rows after a 200-slot cache; min, p10, median of ``--rounds`` runs, interleaved),
  with the load average before and after;
* agreement on real features (the first ``--per-category`` Spec-Bench first turns per category, greedy answers of
  96 tokens): top-1 and top-10 overlap of every committed row, 4-deep greedy chains from every 4th answer slot
  (each graph with its own cache and predictions), and each graph's top-1 against the target's next token;
* agreement on random features (300 draws of 4 rows after 200 random slots).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from specdec_edge import Pipeline
from specdec_edge.bench.spec_bench import load_prompts
from specdec_edge.export.graph import save
from specdec_edge.export.head_builder import build_head_graph
from specdec_edge.export.head_export import _write_graph, target_weights
from specdec_edge.export.head_recipes import recipe_for
from specdec_edge.export.heads_folder import load_heads
from specdec_edge.runtime.base import causal_bias


def inputs(cfg, committed, drafted, ids, positions, past_k, past_v, rows) -> dict:
    """A head step's inputs: ``committed`` target features [S1, F] and ``drafted`` own outputs [S2, H]."""
    feed = {"features": np.concatenate([committed, drafted]) if cfg.method == "eagle" else drafted}
    if cfg.method == "eagle3":
        feed["target_features"] = committed
    feed = {k: np.ascontiguousarray(v[None], np.float32) for k, v in feed.items()}
    total = past_k.shape[1] + len(ids)
    return {**feed, "input_ids": np.asarray(ids, np.int64)[None], "position_ids": np.asarray(positions)[None],
            "past_key": past_k, "past_value": past_v, "attention_bias": causal_bias(total - len(ids), len(ids)),
            "logit_rows": np.asarray(rows, np.int64)}  # fmt: skip


def timing(sessions: dict, cfg, rounds: int) -> None:
    rng, past, kvh, hd = np.random.default_rng(0), 200, cfg.num_kv_heads, cfg.head_dim
    width = len(cfg.feature_layers) * cfg.hidden_size if cfg.feature_layers else cfg.hidden_size
    cache = [rng.standard_normal((1, past, kvh, hd)).astype(np.float32) for _ in range(2)]
    print("load average before:", os.getloadavg())
    for seq in (1, 4):
        committed = rng.standard_normal((seq, width)) if cfg.method == "eagle" else np.zeros((0, width))
        drafted = (
            np.zeros((0, cfg.hidden_size)) if cfg.method == "eagle" else rng.standard_normal((seq, cfg.hidden_size))
        )
        feed = inputs(cfg, committed, drafted, rng.integers(0, cfg.vocab_size, seq), np.full(seq, past), *cache,
                      np.arange(seq))  # fmt: skip
        times = {name: [] for name in sessions}
        for _ in range(30):
            [s.run(None, feed) for s in sessions.values()]
        names = list(sessions)
        for r in range(rounds):
            for name in names[r % 2 :] + names[: r % 2]:
                t = time.perf_counter()
                sessions[name].run(None, feed)
                times[name].append(time.perf_counter() - t)
        for name, ts in times.items():
            ms = np.array(ts) * 1e3
            p10, median = np.percentile(ms, 10), np.median(ms)
            print(f"seq {seq} {name:7s} min {ms.min():.3f}  p10 {p10:.3f}  median {median:.3f} ms")
    print("load average after:", os.getloadavg())


def chains(sessions: dict, cfg, outs: list, feats, seq, start: int) -> list[list[list[int]]]:
    """Per answer slot (every 4th from ``start``): each graph's 4-deep greedy chain, from its own cache."""
    got = []
    empty = np.zeros((0, feats.shape[1]))
    for slot in range(start, len(seq) - 1, 4):
        per_graph = []
        for s, (hidden, _, top, key, value) in zip(sessions.values(), outs):
            pk, pv, feat, chain = key[:, : slot + 1], value[:, : slot + 1], hidden[0, slot], [int(top[slot, 0])]
            for d in range(1, 4):
                h, _, t, k, v = s.run(None, inputs(cfg, empty, feat[None], chain[-1:], [slot + d], pk, pv, [0]))
                pk, pv, feat = np.concatenate([pk, k], 1), np.concatenate([pv, v], 1), h[0, 0]
                chain.append(int(t[0, 0]))
            per_graph.append(chain)
        got.append(per_graph)
    return got


def real_agreement(sessions: dict, cfg, bundle: Path, per_category: int) -> None:
    pipe = Pipeline.load(bundle, method="plain", threads=2)
    top1, overlap, hits, same_chain = [], [], [[], []], []
    for prompt in load_prompts(n_per_category=per_category):
        messages = [{"role": "user", "content": prompt.turns[0]}]
        ids = list(pipe.encode(messages))
        seq = ids + list(pipe.generate(messages, max_new_tokens=96).token_ids)
        pipe.engines.target.reset()
        out = pipe.engines.target.run(np.array(seq))
        feats = np.array(out.layer_features if cfg.method == "eagle3" else out.hidden_states)  # [n, F]
        pipe.engines.target.reset()
        n, kv = len(seq), np.zeros((1, 0, cfg.num_kv_heads, cfg.head_dim), np.float32)
        feed = inputs(cfg, feats[: n - 1], np.zeros((0, cfg.hidden_size)), seq[1:], np.arange(n - 1), kv, kv,
                      np.arange(n - 1))  # fmt: skip
        outs = [s.run(None, feed) for s in sessions.values()]
        (a, b) = (o[2] for o in outs)
        top1 += list(a[:, 0] == b[:, 0])
        overlap += [len(set(x) & set(y)) / len(x) for x, y in zip(a, b)]
        for i, o in enumerate(outs):
            hits[i] += list(o[2][len(ids) - 2 : n - 2, 0] == np.array(seq[len(ids) :]))
        same_chain += [c[0] == c[1] for c in chains(sessions, cfg, outs, feats, seq, len(ids) - 1)]
    print(f"real features: {len(top1)} rows, top-1 same {np.mean(top1):.4f}, top-10 overlap {np.mean(overlap):.4f}; "
          f"{len(same_chain)} 4-token chains, identical {np.mean(same_chain):.4f}; top-1 == target's next answer "
          f"token: traced {np.mean(hits[0]):.4f}, built {np.mean(hits[1]):.4f}")  # fmt: skip


def random_agreement(sessions: dict, cfg) -> None:
    rng, top1, overlap = np.random.default_rng(1), [], []
    width = len(cfg.feature_layers) * cfg.hidden_size if cfg.feature_layers else cfg.hidden_size
    for _ in range(300):
        cache = [rng.standard_normal((1, 200, cfg.num_kv_heads, cfg.head_dim)).astype(np.float32) for _ in range(2)]
        feed = inputs(cfg, rng.standard_normal((4, width)), np.zeros((0, cfg.hidden_size)),
                      rng.integers(0, cfg.vocab_size, 4), np.arange(200, 204), *cache, np.arange(4))  # fmt: skip
        a, b = (s.run(None, feed)[2] for s in sessions.values())
        top1 += list(a[:, 0] == b[:, 0])
        overlap += [len(set(x) & set(y)) / len(x) for x, y in zip(a, b)]
    print(f"random features: {len(top1)} rows, top-1 same {np.mean(top1):.4f}, top-10 overlap {np.mean(overlap):.4f}")


def main() -> None:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--heads", type=Path, required=True)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    head = load_heads(args.heads, *target_weights(args.bundle))
    recipe, cfg = recipe_for(head.cfg.method), head.cfg
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    with tempfile.TemporaryDirectory() as tmp:
        traced, built = Path(tmp) / "traced.onnx", Path(tmp) / "built.onnx"
        _write_graph(recipe.graph(head), recipe, recipe.examples(cfg)[0], traced)
        save(build_head_graph(head), built)
        sessions = {n: ort.InferenceSession(str(p), options, ["CPUExecutionProvider"])
                    for n, p in (("traced", traced), ("built", built))}  # fmt: skip
        timing(sessions, cfg, args.rounds)
        real_agreement(sessions, cfg, args.bundle, args.per_category)
        random_agreement(sessions, cfg)


if __name__ == "__main__":
    main()
