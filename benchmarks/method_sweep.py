"""Several configurations of speculative methods against plain, interleaved per prompt, one process.

Usage:
  python benchmarks/method_sweep.py BUNDLE --config plain --config eagle:k=4,topk=6,nodes=16 \\
      --config eagle:k=3,topk=1,nodes=3 --config pld:k=4 --n-per-category 1 --max-new-tokens 96

Each --config is METHOD[:KEY=VALUE,...] (k is the speculation length, the rest go to the method;
values are JSON, items separated by ';' when a value has commas: 'medusa:k=3;tree=[[0],[0,0]]').
Prompts: the first turns of the packaged Spec-Bench copy, the first N per category (what `bench`
measures; `train-draft --holdout 2` keeps them out of the training data), or of ``--prompts FILE`` (the same
JSONL form). Prints, per config:
decode tokens/s and its ratio to plain's, tokens per target pass, the decode time split into
draft / verify / other per emitted token, and how many outputs equal plain's; then, per config, the
share of passes that accepted at least 1, 2, 3, 4 draft tokens (for a chain, e.g.
``eagle3:k=4,topk=1,nodes=4,depth=4``: the draft's top-1 agreement by position, cumulative).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from specdec_edge import Pipeline
from specdec_edge.bench.spec_bench import load_prompts


def parse_config(text: str) -> tuple[str, str, int, dict]:
    """``METHOD[:KEY=VALUE,...]``; values are JSON (separate items with ';' when a value holds commas)."""
    method, _, rest = text.partition(":")
    options = {}
    for item in filter(None, rest.split(";" if ";" in rest else ",")):
        key, _, value = item.partition("=")
        options[key] = json.loads(value)
    k = int(options.pop("k", 4))
    return text, method, k, options


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--config", action="append", default=[])
    ap.add_argument("--prompts", default=None, help="Spec-Bench style JSONL (default: the packaged Spec-Bench copy).")
    ap.add_argument("--n-per-category", type=int, default=1)
    ap.add_argument("--categories", default=None, help="Comma-separated categories (default: all).")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    base = Pipeline.load(args.bundle, method="plain", threads=args.threads, history=False)
    configs = [parse_config(c) for c in args.config if c != "plain"]
    pipes = {"plain": base, **{name: base.with_method(m, k=k, **o) for name, m, k, o in configs}}
    totals = {name: {"tokens": 0, "decode": 0.0, "draft": 0.0, "verify": 0.0, "steps": 0, "same": 0} for name in pipes}
    lengths = {name: Counter() for name in pipes}
    categories = args.categories.split(",") if args.categories else None
    prompts = load_prompts(args.prompts, categories, args.n_per_category)
    for pipe in pipes.values():  # warm-up
        pipe.generate([{"role": "user", "content": "Say hello."}], max_new_tokens=8)
    for i, prompt in enumerate(prompts):
        messages = [{"role": "user", "content": prompt.turns[0]}]
        base.generate(messages, max_new_tokens=1)  # plans this prompt's prefill shapes, untimed
        want = None
        for name, pipe in pipes.items():
            result = pipe.generate(messages, max_new_tokens=args.max_new_tokens, reuse=False)
            s, t = result.stats, totals[name]
            t["tokens"] += s.new_tokens
            t["decode"] += s.decode_s
            t["draft"] += s.draft_s
            t["verify"] += s.verify_s
            t["steps"] += s.steps
            lengths[name].update(s.accepted_lengths)
            want = result.token_ids if name == "plain" else want
            t["same"] += result.token_ids == want
        print(f"prompt {i + 1}/{len(prompts)} ({prompt.category}) done", flush=True)
    plain_rate = totals["plain"]["tokens"] / totals["plain"]["decode"]
    print(f"\n{len(prompts)} prompts, {args.max_new_tokens} new tokens max, {args.threads} threads, greedy\n")
    print("| config | decode tok/s | vs plain | tokens/pass | draft ms/tok | verify ms/tok | other ms/tok | == plain |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, t in totals.items():
        n = t["tokens"]
        rate = n / t["decode"]
        other = t["decode"] - t["draft"] - t["verify"]
        print(
            f"| {name} | {rate:.1f} | {rate / plain_rate:.2f}x | {n / t['steps']:.2f} | {1e3 * t['draft'] / n:.1f} "
            f"| {1e3 * t['verify'] / n:.1f} | {1e3 * other / n:.1f} | {t['same']}/{len(prompts)} |"
        )
    print("\n| config | passes | accepted >= 1 | >= 2 | >= 3 | >= 4 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, counts in lengths.items():
        passes = sum(counts.values()) or 1
        share = [sum(c for n, c in counts.items() if n >= d) / passes for d in (1, 2, 3, 4)]
        print(f"| {name} | {passes} | " + " | ".join(f"{100 * x:.0f} %" for x in share) + " |")


if __name__ == "__main__":
    main()
