"""Whole calls with the prompt prefilled by two prefill runtimes (``--prefill``: the target graph in ONNX Runtime,
OpenVINO, or the bundle's prefill graph ``fp32``; runtime/prefill_choice.py): plain and auto, the four pipelines
interleaved per prompt (order rotated) in one process; outputs identical to plain under each prefill; greedy
output's common prefix with an fp32 bundle's (fidelity beside the speed).

Usage:
  python benchmarks/ab_prefill.py BUNDLE FP32_BUNDLE --n-per-category 2 --max-new-tokens 128 --json ab.json
  python benchmarks/ab_prefill.py BUNDLE FP32_BUNDLE --prefills onnxruntime fp32

FP32_BUNDLE: `specdec-edge export --target $GGUF --dtype fp32 --out FP32_BUNDLE` (the reference). Prompts: turn 1 of
the packaged Spec-Bench prompts, --n-per-category of each category. Printed: whole-call tokens/s per pipeline (all
tokens over all seconds: outputs may differ in length between the two prefills), identical-to-plain counts, and
the mean common prefix with the fp32 bundle's greedy output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specdec_edge import Pipeline
from specdec_edge.bench.spec_bench import load_prompts

PREFILLS = ["onnxruntime", "openvino"]  # the two compared (--prefills), the first the baseline


def common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run(bundle: str, reference: str, n: int, new: int) -> list[dict]:
    prompts = [(p.category, p.turns[0]) for p in load_prompts(None, None, n)]
    pipes = {f"{m}/{pf}": Pipeline.load(bundle, method=m, prefill=pf) for pf in PREFILLS for m in ("plain", "auto")}
    fp32 = Pipeline.load(reference, method="plain", prefill="onnxruntime")
    for pipe in pipes.values():  # warm-up: OpenVINO's shapes, ONNX Runtime's arenas
        pipe.generate([{"role": "user", "content": prompts[0][1]}], max_new_tokens=8, reuse=False)
    rows = []
    for i, (category, text) in enumerate(prompts):
        messages = [{"role": "user", "content": text}]
        names = list(pipes)[i % 4 :] + list(pipes)[: i % 4]
        row = {"category": category, "prompt_tokens": len(pipes["plain/onnxruntime"].encode(messages))}
        for name in names:
            start = time.perf_counter()
            out = pipes[name].generate(messages, max_new_tokens=new, reuse=False)
            row[name] = {"s": time.perf_counter() - start, "tokens": out.token_ids}
        ref = fp32.generate(messages, max_new_tokens=new, reuse=False).token_ids
        for pf in PREFILLS:
            row[f"fp32_prefix/{pf}"] = common_prefix(row[f"plain/{pf}"]["tokens"], ref)
        rows.append(row)
        print(i, category, row["prompt_tokens"], {k: round(v["s"], 3) for k, v in row.items() if isinstance(v, dict)})
    return rows


def report(rows: list[dict]) -> None:
    names = [k for k in rows[0] if isinstance(rows[0][k], dict)]

    def rate(name: str) -> float:
        return sum(len(r[name]["tokens"]) for r in rows) / sum(r[name]["s"] for r in rows)

    print("\n| pipeline | whole-call tok/s | identical to plain (same prefill) |\n|---|---:|---:|")
    for name in sorted(names, key=lambda x: (x.split("/")[1], x)):
        plain = "plain/" + name.split("/")[1]
        same = sum(r[name]["tokens"] == r[plain]["tokens"] for r in rows)
        print(f"| {name} | {rate(name):.1f} | {same} of {len(rows)} |")
    for m in ("plain", "auto"):
        ratio = rate(f"{m}/{PREFILLS[1]}") / rate(f"{m}/{PREFILLS[0]}")
        print(f"{m}: {PREFILLS[1]} prefill / {PREFILLS[0]} prefill, whole calls {ratio:.3f}x")
    for pf in PREFILLS:
        mean = statistics.mean(r[f"fp32_prefix/{pf}"] for r in rows)
        print(f"common prefix with fp32, plain/{pf}: mean {mean:.1f} tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("reference", help="an fp32 bundle of the same model")
    ap.add_argument("--n-per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--prefills", nargs=2, default=PREFILLS, metavar=("BASE", "OTHER"))
    args = ap.parse_args()
    PREFILLS[:] = args.prefills
    rows = run(args.bundle, args.reference, args.n_per_category, args.max_new_tokens)
    report(rows)
    if args.json:
        slim = [
            {k: ({"s": v["s"], "n": len(v["tokens"])} if isinstance(v, dict) else v) for k, v in r.items()}
            for r in rows
        ]
        with open(args.json, "w") as f:
            json.dump(slim, f, indent=1)


if __name__ == "__main__":
    main()
