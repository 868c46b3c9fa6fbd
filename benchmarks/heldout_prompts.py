"""Prompts no benchmark and no head has seen: the requests of one corpus shard, as Spec-Bench style JSONL.

Usage:
  python benchmarks/heldout_prompts.py corpus/smollm2-135m-instruct --shard 165 --n 26 --out heldout165.jsonl
  specdec-edge bench BUNDLE --methods plain,auto --prompts heldout165.jsonl --n-per-category 26

Issue 36 asks that prompts the benchmark never saw show the same gains as Spec-Bench. The corpus's requests are
written by the model itself and kept apart from Spec-Bench (``export/corpus.py``); a shard written after the heads
were trained (training/README.md names the shards each head saw) holds requests they never saw. Each line:
``{"question_id": SHARD * 1000 + i, "category": "heldout", "turns": [request]}``, the first ``--n`` of the shard.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from specdec_edge.errors import SpecdecError
from specdec_edge.export.corpus import Corpus


def heldout_prompts(folder: str | Path, shard: int, n: int) -> list[dict]:
    """The first ``n`` requests of shard ``shard`` of the corpus in ``folder`` as Spec-Bench records."""
    corpus = Corpus.read(folder)
    found = next((s for s in corpus.shards if s["shard"] == shard), None)
    if found is None:
        have = [s["shard"] for s in corpus.shards]
        raise SpecdecError(f"{folder} has no shard {shard} (shards {have[0]}-{have[-1]}); name one of them.")
    requests = [request for request, _, _ in corpus.records(found)][:n]
    return [{"question_id": shard * 1000 + i, "category": "heldout", "turns": [r]} for i, r in enumerate(requests)]


def write_jsonl(records: list[dict], out: str | Path) -> Path:
    """``records`` one JSON object a line, written whole or not at all (temp file + rename)."""
    out = Path(out)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    with os.fdopen(fd, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", help="corpus folder (specdec-edge corpus)")
    ap.add_argument("--shard", type=int, required=True, help="a shard the heads did not train on")
    ap.add_argument("--n", type=int, default=26, help="requests to take, from the shard's first (default 26)")
    ap.add_argument("--out", required=True, help="JSONL file to write")
    args = ap.parse_args()
    try:
        records = heldout_prompts(args.corpus, args.shard, args.n)
    except SpecdecError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {len(records)} requests of shard {args.shard} to {write_jsonl(records, args.out)}")


if __name__ == "__main__":
    main()
