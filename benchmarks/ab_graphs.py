"""Interleaved A/B of target graph files that share one bundle's graph spec: plain decode and pass cost by width.

Usage:
  python benchmarks/ab_graphs.py BUNDLE before=target/model.onnx after=/tmp/b/smol-gguf-new/target/model.onnx \
      --rounds 12 --steps 32 --past 256 --widths 2 5 8 --threads 1 --cpu-time

Each NAME=PATH is a graph file (relative to BUNDLE or absolute; an edited copy of a graph must lie in the folder
of the external data it reads). Every round runs each graph in turn: a prefill of ``--past`` random tokens, then
``--steps`` single-token decode passes (through the engine, so padded to the bundle's minimum width), then
``--reps`` passes of each width. ``--cpu-time`` measures the process's CPU time instead of wall time: with one
thread it ignores the time the OS gives to other jobs, the steadier figure on a shared, loaded machine (memory
traffic of other jobs still counts). Prints the medians over rounds, each graph's ratio to the first, and
whether its decode logits are bit-identical to the first's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import CpuThreads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("graphs", nargs="+", help="NAME=PATH")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--widths", type=int, nargs="*", default=[2, 5, 8])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    spec = read_manifest(args.bundle).target.graph
    engines = {}
    for item in args.graphs:
        name, path = item.split("=", 1)
        engines[name] = OrtEngine(args.bundle / path, spec, cpu=CpuThreads(args.threads))
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    ids = np.random.default_rng(0).integers(0, spec.vocab_size, args.past + max(args.steps, *args.widths, 1))
    decode = {k: [] for k in engines}
    width = {(k, s): [] for k in engines for s in args.widths}
    logits = {}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            engine.reset()
            engine.run(ids[: args.past], logits_to_keep=1)
            engine.commit(args.past)
            rows, t0 = [], clock()
            for i in range(args.steps):
                rows.append(engine.run([int(ids[args.past + i])]).logits[0].copy())
                engine.commit(1)
            decode[name].append(1000 * (clock() - t0) / args.steps)
            logits.setdefault(name, np.stack(rows))
            for s in args.widths:
                chunk = ids[args.past : args.past + s]
                engine.run(chunk)  # warm
                t0 = clock()
                for _ in range(args.reps):
                    engine.run(chunk)
                width[(name, s)].append(1000 * (clock() - t0) / args.reps)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    unit = "CPU ms" if args.cpu_time else "ms"
    first = next(iter(engines))
    print(
        f"| graph | decode {unit}/token | " + " | ".join(f"S={s} {unit}" for s in args.widths) + " | decode vs "
        f"{first} | logits bit-identical to {first} | argmax agreement with {first} |"
    )
    print("|---|---:|" + "---:|" * len(args.widths) + "---:|---|---:|")
    for name in engines:
        d = statistics.median(decode[name])
        cells = " | ".join(f"{statistics.median(width[(name, s)]):.1f}" for s in args.widths)
        same = np.array_equal(logits[name], logits[first])
        agree = (logits[name].argmax(-1) == logits[first].argmax(-1)).mean()
        ratio = d / statistics.median(decode[first])
        print(f"| {name} | {d:.2f} | {cells} | {ratio:.3f} | {same} | {agree:.2f} |")
        print(f"<!-- {name} rounds: {' '.join(f'{v:.1f}' for v in decode[name])} -->")


if __name__ == "__main__":
    main()
