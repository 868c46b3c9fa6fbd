"""Measure a bundle's exactness verdict on this machine now (runtime/verdicts.py), uncached, and print it.

    python benchmarks/verdict.py BUNDLE [--threads 2]

Prints whether the target graph is batch invariant, the widest exact pass, the failed widths, the key-count
boundaries and residues (mod 16) where passes are cut, whether trees match, the rows compared and the seconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.runtime.factory import open_engine
from specdec_edge.runtime.threads import CpuThreads
from specdec_edge.runtime.verdicts import measure

KEYS = ("batch_invariant", "max_width", "failed_widths", "boundaries", "bad_residues", "tree_invariant")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    manifest = read_manifest(args.bundle)
    engine = open_engine(args.bundle, manifest.target.graph, cpu=CpuThreads(threads=args.threads))
    result = measure(engine)
    print(json.dumps({"bundle": args.bundle.name, **{k: result[k] for k in (*KEYS, "rows_compared", "seconds")}}))


if __name__ == "__main__":
    main()
