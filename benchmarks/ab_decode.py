"""A/B single-token decode latency of two bundles, alternated in one process.

Usage:
  python benchmarks/ab_decode.py /tmp/b/smol-fp32-old /tmp/b/smol-fp32 --rounds 6 --steps 40 --past 300

Alternating rounds keep machine load from favouring either side; prints per-round ms/token and medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import CpuThreads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs=2, type=Path)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--past", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    engines = {}
    for bundle in args.bundles:
        m = read_manifest(bundle)
        engines[bundle] = OrtEngine(bundle / m.target.graph.path, m.target.graph, cpu=CpuThreads(args.threads))
    ids = np.random.default_rng(0).integers(0, next(iter(engines.values())).vocab_size, args.past)
    times: dict = {b: [] for b in engines}
    for _ in range(args.rounds):
        for bundle, engine in engines.items():
            engine.reset()
            engine.run(ids, logits_to_keep=1)
            engine.commit(len(ids))
            start = time.perf_counter()
            for i in range(args.steps):
                engine.run([int(ids[i])])
                engine.commit(1)
            times[bundle].append(1000 * (time.perf_counter() - start) / args.steps)
    for bundle, values in times.items():
        print(f"{bundle}: {' '.join(f'{v:.1f}' for v in values)} ms/token, median {statistics.median(values):.2f}")


if __name__ == "__main__":
    main()
