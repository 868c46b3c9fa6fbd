"""Heads folders judged by the chains they draft on one bundle, where timing plays no part.

Usage:
  python benchmarks/judge_heads.py BUNDLE PROMPTS.jsonl eagle=training/eagle-gguf eagle=work/e-c225/eagle \\
      [--depths 1 4] [--max-new-tokens 128]

BUNDLE: a target bundle whose graph outputs the features the heads read (``export --hidden-states``; EAGLE-3 heads
also need its ``--heads`` layers). PROMPTS: Spec-Bench style JSONL, first turns (``heldout_prompts.py`` writes the
requests of a corpus shard no head trained on). Each ``METHOD=FOLDER`` is added to a scratch copy of the bundle and
run alone (``export/head_eval.chain_acceptance``: greedy, a chain of each depth); prints one JSON line per head and
depth: the first drafted token's acceptance (``top1``), the mean accepted length by depth and tokens per target pass.
Compare heads on the same bundle and prompts; whether a head pays inside ``auto`` is ``ab_bundles.py``'s question.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec_edge.export.head_eval import chain_acceptance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("prompts", type=Path)
    ap.add_argument("heads", nargs="+", help="METHOD=FOLDER (eagle, eagle3, medusa)")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    prompts = [json.loads(line)["turns"][0] for line in args.prompts.read_text().splitlines() if line.strip()]
    for spec in args.heads:
        method, _, folder = spec.partition("=")
        if not folder:
            ap.error(f"{spec!r}: give METHOD=FOLDER, e.g. eagle=training/eagle-gguf")
        for depth in args.depths:
            result = chain_acceptance(
                Path(folder), args.bundle, prompts, method=method, depth=depth,
                max_new_tokens=args.max_new_tokens, threads=args.threads,
            )  # fmt: skip
            print(json.dumps({"heads": folder, "method": method, "depth": depth, **result}), flush=True)


if __name__ == "__main__":
    main()
