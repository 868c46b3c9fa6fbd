"""One token's row in a verify pass against plain decoding's row for it, pass by pass (the trace that found the
key-count residues on aarch64; docs/JETSON.md). Runs anywhere the light runtime does; inside the arm64 root:

    python /srv/check/arm64_rows.py /srv/bundles/smollm2-gguf 56 72

For every cache length p in [LO, HI): the largest logit difference between row 1 of the two-row chain [a, x]
after p slots and plain decoding's (padded) row for x after p + 1 slots, and between row 0 and plain's row for
a. The verdict is not applied (every pass runs as asked); the engine's padding is two rows, as plain's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.runtime.base import prefill
from specdec_edge.runtime.factory import open_engine
from specdec_edge.runtime.threads import CpuThreads


def main(argv: list[str]) -> int:
    root, lo, hi = Path(argv[0]), int(argv[1]), int(argv[2])
    graph = read_manifest(root).target.graph
    engine = open_engine(root, graph, cpu=CpuThreads(threads=2, spinning=False))
    engine.min_width, engine.boundaries, engine.max_width = 2, (), None
    context = np.random.default_rng(2).integers(0, min(2000, graph.vocab_size), hi + 3)
    prefill(engine, context[:lo])
    for p in range(lo, hi):
        a, x = int(context[p]), int(context[p + 1])
        engine.rollback(p)
        chain = np.array(engine.run(np.asarray([a, x])).logits, dtype=np.float32)
        engine.rollback(p)
        plain_a = np.array(engine.run(np.asarray([a])).logits, dtype=np.float32)[0]
        engine.commit(1)  # slot p as plain decoding writes it
        plain_x = np.array(engine.run(np.asarray([x])).logits, dtype=np.float32)[0]
        d1, d0 = float(np.abs(chain[1] - plain_x).max()), float(np.abs(chain[0] - plain_a).max())
        print(f"p {p} (p mod 4 = {p % 4}): last row {d1:.3g}, first row {d0:.3g}", flush=True)
        engine.rollback(p + 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
