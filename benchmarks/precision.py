"""Compare bundle precisions of one model: size, single-token latency, greedy agreement with fp32.

Usage:
  python benchmarks/precision.py --ref bundles/smol-fp32 bundles/smol-fp16 bundles/smol-int8 ... \
      --prompts ../shared/data/spec_bench_question.jsonl --n 20 --new-tokens 64

Greedy decoding here is the plain one-token loop on the engine (no speculation), so the
numbers isolate the precision. Agreement: share of prompts whose greedy continuation equals
the fp32 one token for token, and the mean length of the common prefix (``--json``: per prompt, for paired
comparisons of two graphs of one model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import CpuThreads
from specdec_edge.tokenizer import Tokenizer


def load_prompts(path: Path, n: int) -> list[list[dict]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_cat: dict[str, list] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r)
    cats = sorted(by_cat)
    picked = [by_cat[cats[i % len(cats)]][i // len(cats)] for i in range(n)]
    return [[{"role": "user", "content": r["turns"][0]}] for r in picked]


def greedy(engine: OrtEngine, prompt_ids: list[int], new_tokens: int, eos: set) -> tuple[list[int], list[float]]:
    engine.reset()
    out = engine.run(prompt_ids)
    engine.commit(len(prompt_ids))
    token = int(out.logits[-1].argmax())
    tokens, step_times = [token], []
    while len(tokens) < new_tokens and token not in eos:
        t0 = time.perf_counter()
        out = engine.run([token])
        step_times.append(time.perf_counter() - t0)
        engine.commit(1)
        token = int(out.logits[0].argmax())
        tokens.append(token)
    return tokens, step_times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+", type=Path)
    ap.add_argument("--ref", type=Path, required=True, help="fp32 bundle to compare against")
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write each prompt's common prefix with fp32, per graph, here")
    args = ap.parse_args()

    manifest = read_manifest(args.ref)
    tok = Tokenizer.from_bundle(args.ref, manifest.tokenizer)
    eos = set(manifest.tokenizer.eos_token_ids)
    prompts = [
        tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in load_prompts(args.prompts, args.n)
    ]
    results = {}
    for bundle in [args.ref, *args.bundles]:
        m = read_manifest(bundle)
        engine = OrtEngine(bundle / m.target.graph.path, m.target.graph, cpu=CpuThreads(args.threads))
        outs, times = [], []
        for ids in prompts:
            toks, st = greedy(engine, ids, args.new_tokens, eos)
            outs.append(toks)
            times += st
        size = sum(e["size"] for rel, e in m.files.items() if rel.startswith("target/"))
        results[str(bundle)] = {
            "dtype": f"{m.target.graph.flavour} {m.target.graph.dtype}",
            "outs": outs,
            "ms": 1000 * statistics.median(times),
            "mb": size / 1e6,
        }
    ref = results[str(args.ref)]["outs"]
    print("| graph | size (MB) | median ms / token (S=1) | identical to fp32 | mean common prefix (tokens) |")
    print("|---|---|---|---|---|")
    prefixes = {}
    for name, r in results.items():
        same = [a == b for a, b in zip(r["outs"], ref)]
        prefix = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            for a, b in zip(r["outs"], ref)
        ]
        print(f"| {r['dtype']} | {r['mb']:.0f} | {r['ms']:.1f} | {sum(same)}/{len(same)} | {np.mean(prefix):.1f} |")
        prefixes[name] = prefix
    if args.json:
        args.json.write_text(json.dumps({"new_tokens": args.new_tokens, "common_prefix": prefixes}, indent=1))


if __name__ == "__main__":
    main()
