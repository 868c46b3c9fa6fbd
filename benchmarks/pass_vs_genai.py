"""One target pass, ours against onnxruntime-genai's graph, without the profiler (its per-node cost is larger on our
897-node graph than on genai's 343), interleaved.

Usage:
  python benchmarks/pass_vs_genai.py BUNDLE GENAI_DIR --threads 2 --past 256 --widths 1 2 5 8 --rounds 6 --reps 20

BUNDLE's target through our engine (one-row passes padded to the bundle's minimum width, as decoding runs them),
after a prefill of ``--past`` random tokens; GENAI_DIR (``benchmarks/peers.py``'s ``genai_model`` builds one) run
the way onnxruntime-genai's CPU path runs it: the same tokens, the past K/V in and the presents out (no shared
buffer), one-row passes unpadded. Both in one process on the same thread pool. Prints the median ms per pass of
each width and the ratio ours / genai.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import CpuThreads, cpu_session_options


class GenaiGraph:
    """onnxruntime-genai's decoder graph driven as its CPU path drives it (past -> present)."""

    def __init__(self, folder: Path, threads: int, options: ort.SessionOptions | None = None):
        """``options``: the session's (default: our engines' CPU options and thread pool for ``threads``)."""
        config = json.loads((folder / "genai_config.json").read_text())["model"]
        dec = config["decoder"]
        self.path, self.names, self.vocab_size = folder / dec["filename"], dec["inputs"], config["vocab_size"]
        self.layers, self.kv_heads, self.head = dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"]
        options = options or cpu_session_options(CpuThreads(threads))
        self.session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])

    def empty(self) -> list[np.ndarray]:
        return [np.zeros((1, self.kv_heads, 0, self.head), np.float32)] * (2 * self.layers)

    def run(self, ids, past: list[np.ndarray]) -> list[np.ndarray]:
        """The presents after ``ids`` (key, value per layer)."""
        feed = {
            self.names["input_ids"]: np.asarray(ids, np.int64)[None],
            self.names["attention_mask"]: np.ones((1, past[0].shape[2] + len(ids)), np.int64),
        }
        for i in range(self.layers):
            feed[self.names["past_key_names"] % i] = past[2 * i]
            feed[self.names["past_value_names"] % i] = past[2 * i + 1]
        return self.session.run(None, feed)[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("genai", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 5, 8])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    graph = read_manifest(args.bundle).target.graph
    ours = OrtEngine(args.bundle / graph.path, graph, cpu=CpuThreads(args.threads))
    genai = GenaiGraph(args.genai, args.threads)
    rng = np.random.default_rng(0)
    context = rng.integers(0, graph.vocab_size, args.past)
    ours.run(context, logits_to_keep=1)
    ours.commit(args.past)
    past = genai.run(context, genai.empty())
    times = {(who, w): [] for who in ("ours", "genai") for w in args.widths}
    for _ in range(args.rounds):
        for w in args.widths:
            ids = rng.integers(0, graph.vocab_size, w)
            start = time.perf_counter()
            for _ in range(args.reps):
                ours.run(ids)
                ours.rollback(args.past)
            times[("ours", w)].append((time.perf_counter() - start) / args.reps * 1e3)
            start = time.perf_counter()
            for _ in range(args.reps):
                genai.run(ids, past)
            times[("genai", w)].append((time.perf_counter() - start) / args.reps * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"threads {args.threads}, past {args.past}; ms per pass, median of {args.rounds} rounds x {args.reps}")
    print("| width | ours | genai | ours / genai |\n|---:|---:|---:|---:|")
    for w in args.widths:
        a, b = med[("ours", w)], med[("genai", w)]
        print(f"| {w} | {a:.2f} | {b:.2f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
