"""Prompts no benchmark and no head has seen: the requests of one corpus shard, as Spec-Bench style JSONL.

Usage:
  python benchmarks/heldout_prompts.py corpus/smollm2-135m-instruct --shard 165 --n 26 --out heldout165.jsonl
  specdec-edge bench BUNDLE --methods plain,auto --prompts heldout165.jsonl --n-per-category 26

Issue 36 asks that prompts the benchmark never saw show the same gains as Spec-Bench. The corpus's requests are
written by the model itself and kept apart from Spec-Bench (``export/corpus.py``); a shard written after the heads
were trained (training/README.md names the shards each head saw) holds requests they never saw. Each line:
``{"question_id": SHARD * 1000 + i, "category": "heldout", "turns": [request]}``, the first ``--n`` of the shard.

``--edit TOKENIZER``: edits of a given text instead (category ``edit``): the shard's first answers, decoded with
TOKENIZER (a bundle's tokenizer.json) and cut after their last full sentence, each behind one of ``EDITS`` in turn
(answers that repeat themselves, a small model's greedy loops, are left out); an answer that rewrites its prompt is
where prompt lookup's chains run long (docs/PERFORMANCE.md, "Where speculation pays").

  python benchmarks/heldout_prompts.py corpus/smollm2-135m-instruct --shard 374 --n 24 --edit BUNDLE/tokenizer.json \\
      --out edit374.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from specdec_edge.errors import SpecdecError
from specdec_edge.export.corpus import Corpus, distinct_4grams


def heldout_prompts(folder: str | Path, shard: int, n: int) -> list[dict]:
    """The first ``n`` requests of shard ``shard`` of the corpus in ``folder`` as Spec-Bench records."""
    corpus = Corpus.read(folder)
    found = next((s for s in corpus.shards if s["shard"] == shard), None)
    if found is None:
        have = [s["shard"] for s in corpus.shards]
        raise SpecdecError(f"{folder} has no shard {shard} (shards {have[0]}-{have[-1]}); name one of them.")
    requests = [request for request, _, _ in corpus.records(found)][:n]
    return [{"question_id": shard * 1000 + i, "category": "heldout", "turns": [r]} for i, r in enumerate(requests)]


EDITS = (
    "Correct any spelling and grammar mistakes in the following text and return the corrected text:",
    "Rewrite the following text in a more formal tone:",
    "Repeat the following text, but replace every mention of 'you' with 'the reader':",
    "Format the following text as a bulleted list, keeping its sentences:",
)


def edit_prompts(folder: str | Path, shard: int, n: int, tokenizer: str | Path) -> list[dict]:
    """The first ``n`` answers of shard ``shard`` that do not loop, each to be edited (``EDITS`` in turn), as
    Spec-Bench records."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    corpus = Corpus.read(folder)
    found = next((s for s in corpus.shards if s["shard"] == shard), None)
    if found is None:
        raise SpecdecError(f"{folder} has no shard {shard}; name one of its shards.")
    records = []
    for i, (_, ids, start) in enumerate(corpus.records(found)):
        text = tok.decode([int(t) for t in ids[start:]]).strip()
        end = text.rfind(".")
        text = text[: end + 1] if end >= len(text) // 2 else text  # whole sentences where most of it is kept
        if not text or looping(text):
            continue  # a greedy loop is easy to draft for reasons of its own: the figure is about copying
        turn = f"{EDITS[len(records) % len(EDITS)]}\n\n{text}"
        records.append({"question_id": shard * 1000 + i, "category": "edit", "turns": [turn]})
        if len(records) == n:
            break
    return records


def looping(text: str, share: float = 0.9) -> bool:
    """Whether fewer than ``share`` of the text's word 4-grams are distinct (it repeats itself)."""
    return distinct_4grams(text.split()) < share


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
    ap.add_argument("--edit", metavar="TOKENIZER", default=None, help="edits of the shard's answers (above)")
    args = ap.parse_args()
    try:
        if args.edit:
            records = edit_prompts(args.corpus, args.shard, args.n, args.edit)
        else:
            records = heldout_prompts(args.corpus, args.shard, args.n)
    except SpecdecError as e:
        raise SystemExit(f"error: {e}") from None
    what = "edits of the answers" if args.edit else "requests"
    print(f"wrote {len(records)} {what} of shard {args.shard} to {write_jsonl(records, args.out)}")


if __name__ == "__main__":
    main()
