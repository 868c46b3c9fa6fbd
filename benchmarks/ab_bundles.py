"""Two or more bundles, each with plain and other methods, interleaved per prompt in one process: whether a bundle
change (a head, a table, another export) pays, measured so that the machine's drift hits every bundle alike.

Usage:
  python benchmarks/ab_bundles.py --bundle default=BUNDLE_A --bundle head=BUNDLE_B --methods plain,auto \\
      --n-per-category 1 --prompts heldout.jsonl --json ab.json

Prompts: the first ``--turns`` turns of the first N per category of the packaged Spec-Bench copy, and every
prompt of each ``--prompts`` file (Spec-Bench style JSONL); each file is its own row group. Per prompt the
(bundle, method) runs go in a rotated order. Prints per group, bundle and method: decode tok/s, its ratio to the
same bundle's plain and to the first bundle's plain, tokens per target pass, outputs equal to that bundle's
plain, and the median of the per-turn decode-time ratios against the first bundle's same method (the pairwise
figure to trust on a drifting machine). Read the plain rows' pairwise figure first: on machine B (2026-12-06) the
second bundle's plain read 1.02-1.04x the first's in every group, also with byte-identical target graphs, so a
method's ratio to its own bundle's plain is the comparison there.

Step costs: ``auto`` steers by a curve of pass cost over width, measured once per bundle and cached. Bundles whose
target graph is the same file (a head or table A/B) all get the first such bundle's curve, so that the comparison
is of what differs, not of two measurements taken at different loads (a curve measured during a burst of load
once priced 3 rows at 1.34x 2 rows and made a better head look 0.87x). ``--own-costs`` keeps each bundle's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

from specdec_edge import Pipeline
from specdec_edge.bench.spec_bench import load_prompts
from specdec_edge.bundle.manifest import read_manifest


def runs_in_order(names: list[tuple[str, str]], i: int) -> list[tuple[str, str]]:
    """The (bundle, method) pairs rotated by the prompt's index, so that no pair always runs first."""
    shift = i % len(names)
    return names[shift:] + names[:shift]


def target_digest(path: str) -> tuple:
    """The sha256 of the bundle's target graph files: equal for bundles that differ only in heads or tables."""
    files = read_manifest(path, check_files=False).files
    return tuple(sorted((name, entry["sha256"]) for name, entry in files.items() if name.startswith("target/")))


def share_costs(pipes: dict, paths: dict) -> list[str]:
    """Every bundle's ``auto`` gets the step costs of the first bundle with the same target graph; the names of
    the bundles that took another's curve."""
    first, shared = {}, []
    for (name, method), pipe in pipes.items():
        proposer = getattr(pipe.decoder, "proposer", None)
        if method != "auto" or not hasattr(proposer, "costs"):
            continue
        digest = target_digest(paths[name])
        if digest in first:
            proposer.costs = first[digest]
            shared.append(name)
        else:
            first[digest] = proposer.costs
    return shared


def prompt_groups(args) -> dict[str, list]:
    groups = {"spec-bench": load_prompts(None, None, args.n_per_category)} if args.n_per_category else {}
    for path in args.prompts:
        groups[path] = load_prompts(path, None, 10**6)
    return groups


def run_turn(pipes: dict, messages: list, order: list, max_new: int, totals: dict) -> dict:
    """One turn of every (bundle, method) in ``order``; {(bundle, method): result}."""
    results = {}
    for bundle, method in order:
        result = pipes[bundle, method].generate(messages, max_new_tokens=max_new, reuse=False)
        s, t = result.stats, totals[bundle, method]
        t["tokens"] += s.new_tokens
        t["decode"] += s.decode_s
        t["steps"] += s.steps
        t["per_prompt"].append(s.decode_s / max(s.new_tokens, 1))
        results[bundle, method] = result
    for bundle, method in order:
        totals[bundle, method]["same"] += results[bundle, method].token_ids == results[bundle, "plain"].token_ids
    return results


def measure(pipes: dict, prompts: list, max_new: int, turns: int) -> dict:
    """{(bundle, method): {"tokens", "decode", "steps", "same", "per_prompt": [decode s / token per turn]}}. A
    second turn follows the first bundle's plain answer (every exact method's answer is the same)."""
    totals = defaultdict(lambda: {"tokens": 0, "decode": 0.0, "steps": 0, "same": 0, "per_prompt": []})
    names = list(pipes)
    for i, prompt in enumerate(prompts):
        messages = []
        for turn in prompt.turns[:turns]:
            messages.append({"role": "user", "content": turn})
            results = run_turn(pipes, messages, runs_in_order(names, i), max_new, totals)
            messages.append({"role": "assistant", "content": results[names[0][0], "plain"].text})
        print(f"  prompt {i + 1}/{len(prompts)} ({prompt.category})", flush=True)
    return totals


def table(totals: dict, n: int) -> list[str]:
    first = next(iter(totals))[0]
    lines = [
        "| bundle | method | decode tok/s | vs its plain | vs first plain | tokens/pass | == its plain | "
        "pairwise vs first (median) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    rate = {key: t["tokens"] / t["decode"] for key, t in totals.items()}
    for (bundle, method), t in totals.items():
        ref = totals[first, method]["per_prompt"]
        pairwise = statistics.median(a / b for a, b in zip(ref, t["per_prompt"], strict=True))
        lines.append(
            f"| {bundle} | {method} | {rate[bundle, method]:.1f} | {rate[bundle, method] / rate[bundle, 'plain']:.2f}x "
            f"| {rate[bundle, method] / rate[first, 'plain']:.2f}x | {t['tokens'] / t['steps']:.2f} "
            f"| {t['same']}/{n} | {pairwise:.3f}x |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", action="append", required=True, help="NAME=PATH; the first is the reference")
    ap.add_argument("--methods", default="plain,auto", help="comma-separated; plain always runs")
    ap.add_argument("--prompts", action="append", default=[], help="a Spec-Bench style JSONL file (repeatable)")
    ap.add_argument("--n-per-category", type=int, default=1, help="Spec-Bench prompts per category (0: none)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--turns", type=int, default=1, help="turns per prompt (Spec-Bench has 2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--own-costs", action="store_true", help="each bundle's auto keeps its own step costs")
    args = ap.parse_args()
    methods = ["plain"] + [m for m in args.methods.split(",") if m and m != "plain"]
    pipes, paths = {}, {}
    for spec in args.bundle:
        name, sep, path = spec.partition("=")
        if not sep:
            ap.error(f"--bundle {spec!r}: give NAME=PATH")
        paths[name] = path
        base = Pipeline.load(path, method="plain", threads=args.threads, history=False)
        for method in methods:
            pipes[name, method] = base if method == "plain" else base.with_method(method)
    for pipe in pipes.values():  # warm-up: loads, step costs for auto
        pipe.generate([{"role": "user", "content": "Say hello."}], max_new_tokens=8)
    if not args.own_costs:
        for name in share_costs(pipes, paths):
            print(f"{name}: auto uses the step costs of the first bundle with the same target graph", flush=True)
    report = {}
    for group, prompts in prompt_groups(args).items():
        print(f"{group}: {len(prompts)} prompts", flush=True)
        totals = measure(pipes, prompts, args.max_new_tokens, args.turns)
        turns = sum(min(len(p.turns), args.turns) for p in prompts)
        lines = table(totals, turns)
        print(f"\n{group}: {len(prompts)} prompts, {turns} turns, {args.max_new_tokens} new tokens max, greedy\n")
        print("\n".join(lines) + "\n")
        report[group] = {f"{b}/{m}": t for (b, m), t in totals.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "groups": report}, f, indent=1)


if __name__ == "__main__":
    main()
