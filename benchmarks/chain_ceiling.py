"""What a drafted chain can gain on this device, from the step costs it measured: the arithmetic behind issue 36.

Usage:
  python benchmarks/chain_ceiling.py BUNDLE [--acceptance 0.5 0.58 0.7 0.8 0.9 1.0] [--target 1.6]

BUNDLE must have run once on this device (any `generate`, `bench` or `demo` measures and caches its step costs;
this script measures nothing). A greedy step that verifies a chain of L drafted tokens, each accepted with
probability p once its parent was, emits on average 1 + p + p^2 + ... + p^L tokens and costs

    c(L + 1) + L * h + o     (in one-row passes)

where c(w) is the cached cost of a pass of w rows relative to a one-row pass (``CostModel.verify``), h one head run
(the head's measured seconds a step over its depth; ``--head-ms`` to set it) and o the loop's own share of a step
(``--overhead``). Its decode speedup over plain decoding is the ratio. For each p the table gives that ratio at
L = 1..6 and the best L; beside it the same with every row free (c(w) = 1, as on a GPU), and the per-token acceptance
a chain needs to reach ``--target``. Plain decoding's own cost is one one-row pass plus o.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec_edge.api.step_costs import costs_of_bundle
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.speculative.costs import CostModel

DEPTHS = range(1, 7)


def speedup(model: CostModel, context: int, p: float, depth: int, head: float, overhead: float, flat=False) -> float:
    """Decode speedup over plain of a chain of ``depth`` drafts, each accepted with probability ``p``."""
    one = model.verify(1, context)
    rows = 1.0 if flat else model.verify(depth + 1, context) / one
    tokens = 1.0 + sum(p**i for i in range(1, depth + 1))
    return tokens * (1.0 + overhead) / (rows + depth * head / one + overhead)


def needed(model: CostModel, context: int, target: float, head: float, overhead: float) -> float | None:
    """The least per-token acceptance at which some chain length reaches ``target`` (None: not even at 1.0)."""

    def best(p: float) -> float:
        return max(speedup(model, context, p, d, head, overhead) for d in DEPTHS)

    if best(1.0) < target:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if best(mid) < target else (lo, mid)
    return hi


def head_seconds(model: CostModel, bundle: Path, given_ms: float | None) -> float:
    """One head run: ``--head-ms``, else the measured per-step seconds of the bundle's head over its chain depth."""
    if given_ms is not None:
        return given_ms / 1e3
    for name, section in read_manifest(bundle).heads.items():
        if name in model.proposers:
            return model.proposers[name] / max(int(section.tree.get("depth") or 1), 1)
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.58, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0])
    ap.add_argument("--target", type=float, default=1.6, help="decode speedup to find the acceptance for")
    ap.add_argument("--head-ms", type=float, default=None, help="one head run in ms (default: measured, above)")
    ap.add_argument("--overhead", type=float, default=0.03, help="the loop's share of a one-row pass a step")
    args = ap.parse_args()
    models = costs_of_bundle(args.bundle)
    if not models:
        raise SystemExit(
            f"no step costs are cached for {args.bundle} on this machine: run `specdec-edge generate {args.bundle} "
            "--prompt hi --method auto` once, then this again."
        )
    for model in models:
        head = head_seconds(model, args.bundle, args.head_ms)
        key = model.key
        print(f"device {key.get('device', '?')} ({key.get('provider', '?')}), threads {key.get('threads', '?')}")
        print(model.describe())
        for context in model.contexts:
            print(f"\ncontext {context}: one head run {head * 1e3:.2f} ms, loop {args.overhead:.0%} of a pass")
            print("| p | " + " | ".join(f"L={d}" for d in DEPTHS) + " | best | rows free: best |")
            print("|---:|" + "---:|" * (len(DEPTHS) + 2))
            for p in args.acceptance:
                cells = [speedup(model, context, p, d, head, args.overhead) for d in DEPTHS]
                free = max(speedup(model, context, p, d, head, args.overhead, flat=True) for d in DEPTHS)
                row = " | ".join(f"{x:.2f}" for x in cells)
                print(f"| {p:.2f} | {row} | **{max(cells):.2f}** | {free:.2f} |")
            need = needed(model, context, args.target, head, args.overhead)
            where = f"p >= {need:.2f}" if need is not None else "no chain, even at p = 1"
            print(f"decode speedup {args.target:.2f}x needs {where}")


if __name__ == "__main__":
    main()
