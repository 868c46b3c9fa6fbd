"""Latency of one target pass by width S and cache length, per bundle graph.

Usage:
  python benchmarks/engine_speed.py bundles/smol-fp32 bundles/smol-portable --past 256 1024 2000 --widths 1 5 8 16

Prints a Markdown table of median milliseconds per pass (10 repeats after 2 warm-ups).
The cache is filled by a real prefill of random tokens; each timed pass is rolled back.
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
    ap.add_argument("bundles", nargs="+", type=Path)
    ap.add_argument("--past", nargs="+", type=int, default=[256, 2000])
    ap.add_argument("--widths", nargs="+", type=int, default=[1, 5])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| bundle | dtype | flavour | past | " + " | ".join(f"S={s} ms" for s in args.widths) + " |")
    print("|---|---|---|---|" + "---|" * len(args.widths))
    for bundle in args.bundles:
        m = read_manifest(bundle)
        g = m.target.graph
        engine = OrtEngine(bundle / g.path, g, cpu=CpuThreads(args.threads))
        for past in args.past:
            engine.reset()
            for start in range(0, past, 256):  # chunked prefill
                chunk = rng.integers(0, g.vocab_size, min(256, past - start))
                engine.run(chunk)
                engine.commit(len(chunk))
            cells = []
            for s in args.widths:
                ids = rng.integers(0, g.vocab_size, s)
                times = []
                for i in range(args.repeats + 2):
                    t0 = time.perf_counter()
                    engine.run(ids)
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
                cells.append(f"{1000 * statistics.median(times):.1f}")
            print(f"| {bundle.name} | {g.dtype} | {g.flavour} | {past} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
