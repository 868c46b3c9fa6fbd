"""What drafting from history costs per step: ``HistoryStore.lookup`` (and ``HistoryProposer.propose``) on a
store filled to its limit, for contexts that match a stored stream and contexts that match nothing, and
``add`` per 1,000 tokens. No model: the store alone.

Usage:
  python benchmarks/history_lookup.py --mb 16 --steps 20000

Prints microseconds per lookup (median and 99th percentile) and per 1,000 tokens added, with the store's
size; the decode loop's own step costs milliseconds on a CPU (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from specdec_edge.sampling import SamplingParams
from specdec_edge.speculative.history import HistoryProposer, HistoryStore


def timed(fn, steps: int) -> tuple[float, float]:
    """(median, p99) microseconds of ``fn(i)`` over ``steps`` calls."""
    out = []
    for i in range(steps):
        t = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t) * 1e6)
    out.sort()
    return statistics.median(out), out[int(0.99 * (len(out) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=16.0)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    store = HistoryStore.of_mb(args.mb)
    streams, added = [], []
    while store.evicted == 0:  # fill it past its limit once
        stream = rng.integers(0, args.vocab, int(rng.integers(200, 2000)))
        t = time.perf_counter()
        store.add(stream)
        added.append((time.perf_counter() - t) * 1e6 / len(stream) * 1000)
        streams.append(stream)
    recent = streams[-50:]
    hits = [list(s[: int(rng.integers(40, len(s) - 8))]) for s in recent]
    misses = [list(rng.integers(0, args.vocab, 400)) for _ in range(50)]
    print(
        f"store: {store.nbytes / (1 << 20):.1f} MiB, {store.held} tokens held of {store.capacity}, "
        f"{store.streams} streams added, {store.evicted} tokens evicted"
    )
    print(f"add: {statistics.median(added):.0f} us per 1,000 tokens (median)")
    for name, contexts in (("hit", hits), ("miss", misses)):
        med, p99 = timed(lambda i, c=contexts: store.lookup(c[i % len(c)], 8), args.steps)
        print(f"lookup, {name}: {med:.1f} us median, {p99:.1f} us p99")
    proposer = HistoryProposer()
    proposer.prefill(hits[0], SamplingParams(), rng, history=store)
    med, p99 = timed(lambda i: proposer.propose(hits[i % len(hits)], 8), args.steps)
    print(f"HistoryProposer.propose, hit: {med:.1f} us median, {p99:.1f} us p99")
    assert all(len(store.lookup(h, 8)[0]) for h in hits[-10:]), "recent streams must be found"


if __name__ == "__main__":
    main()
