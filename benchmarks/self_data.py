"""Self-written prompts and batched answers against today's answer stage, on one model, in one run.

Usage:
  python benchmarks/self_data.py --target <SmolLM2 GGUF or HF folder> --prompts 64 --batch 32 \\
      --answer-tokens 128 --compare 16 --json self-data.json

1. The target writes ``--prompts`` requests (``self_data.generate_prompts``); printed: a sample, the
   words per request, a coarse topic spread (keyword buckets), what the filter dropped and why.
2. Answers to them: the PyTorch model in batches of ``--batch`` (``self_data.generate_answers``), and
   ``--compare`` of them the way ``train-draft`` made them before, one at a time through our runtime with
   prompt lookup (``draft_data._answer`` on an fp32 bundle with hidden states, exported into --work once).
   Tokens per minute of each; how often the two give the same greedy tokens; how close the features are.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

TOPICS = {
    "coding": ("code", "python", "function", "program", "script", "javascript", "sql", "bug", "algorithm"),
    "math": ("calculate", "solve", "equation", "math", "number", "sum", "probability", "integral"),
    "writing": ("write", "story", "poem", "essay", "letter", "blog", "article", "email"),
    "explain": ("explain", "what is", "what are", "why", "how does", "how do", "describe", "difference"),
    "advice": ("how can i", "should i", "tips", "advice", "help me", "recommend", "best way"),
    "rewrite": ("rewrite", "summarize", "translate", "paraphrase", "edit", "improve", "correct"),
    "list": ("list", "name", "give me", "examples", "ideas"),
}


def topic(text: str) -> str:
    low = text.lower()
    for name, keys in TOPICS.items():
        if any(k in low for k in keys):
            return name
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/self-data"))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--compare", type=int, default=16, help="answers also made the old way (0: skip)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-spinning",
        action="store_true",
        help="sleeping thread pools for both (PyTorch: OMP_WAIT_POLICY=PASSIVE, set before torch loads; ours: "
        "spinning=False): the fair setting on a machine other jobs share",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    if args.no_spinning:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    import torch

    from specdec_edge.export import self_data
    from specdec_edge.export.sources import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.target)
    model, tok = loaded.model, loaded.tokenizer
    t0 = time.perf_counter()
    report = self_data.generate_prompts(model, tok, args.prompts, seed=args.seed, batch=args.batch)
    prompt_s = time.perf_counter() - t0
    texts = report.prompts
    spread = Counter(topic(t) for t in texts)
    result = {"prompts": report.summary(), "prompt_seconds": prompt_s, "topics": dict(spread.most_common())}
    result["machine"] = {"threads": args.threads, "spinning": not args.no_spinning, "load_avg": os.getloadavg()}
    result["sample"] = texts[:: max(1, len(texts) // 12)][:12]
    print(json.dumps(result, indent=1), file=sys.stderr)

    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    batched = self_data.generate_answers(
        model, tok, texts, answer_tokens=args.answer_tokens, capacity=2048, batch=args.batch
    )
    batch_s = time.perf_counter() - t0
    answer_tokens = sum(len(ids) + 1 - start for ids, _, start, _ in batched)
    result["batched"] = {
        "seconds": batch_s,
        "answer_tokens": answer_tokens,
        "tokens_per_min": 60 * answer_tokens / batch_s,
    }

    if args.compare:
        from specdec_edge.api.pipeline import Pipeline
        from specdec_edge.export.draft_data import _answer, prepare_bundle

        bundle = prepare_bundle(args.target, args.work, 2048, progress=True)
        sub = texts[: args.compare]
        with Pipeline.load(bundle, method="plain", threads=args.threads, spinning=not args.no_spinning) as pipe:
            t0 = time.perf_counter()
            ref, _ = _answer(pipe, sub, args.answer_tokens)
            old_s = time.perf_counter() - t0
        old_tokens = sum(len(ids) + 1 - start for ids, _, start, _ in ref)
        same = sum(np.array_equal(a[0], b[0]) for a, b in zip(batched, ref))
        prefix = [
            next(
                (i for i, (x, y) in enumerate(zip(a[0][a[2] :], b[0][b[2] :])) if x != y),
                min(len(a[0]), len(b[0])) - a[2],
            )
            for a, b in zip(batched, ref)
        ]
        errs = [
            float(np.abs(a[1][: len(b[1])].astype(np.float32) - b[1][: len(a[1])].astype(np.float32)).max())
            for a, b in zip(batched, ref)
            if a[2] == b[2]
        ]
        result["runtime_one_at_a_time"] = {
            "prompts": len(sub),
            "seconds": old_s,
            "answer_tokens": old_tokens,
            "tokens_per_min": 60 * old_tokens / old_s,
        }
        result["agreement"] = {
            "identical_answers": f"{same} of {len(ref)}",
            "mean_common_answer_prefix": statistics.mean(prefix) if prefix else 0,
            "max_feature_abs_err": max(errs) if errs else None,
        }
        result["speedup_tokens_per_min"] = (
            result["batched"]["tokens_per_min"] / result["runtime_one_at_a_time"]["tokens_per_min"]
        )
    print(json.dumps({k: v for k, v in result.items() if k != "sample"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
