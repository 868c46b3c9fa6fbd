"""Where a decode step's time outside ONNX Runtime goes: timers around the loop's parts.

Usage:
  python benchmarks/step_parts.py BUNDLE [--method plain] [--n 6] [--max-new-tokens 128] [--noop]

Wraps (in this process only) the target session's run call, ``loop.verify``, the exact acceptance rule,
``loop.near_ties``, the target engine's ``commit`` and the decode generator's steps, then decodes the first turn
of one Spec-Bench prompt per category and prints microseconds per step after the first: inside ONNX Runtime;
the engine's own work around it (verify - ort); the rule; the near-tie scan; the commit; the rest of the loop
(in decode - verify - rule - near - commit); the stream's consumer (step - in decode). ``--noop``: the run call
does nothing (the logits keep their last values), so what is timed is the loop alone, with warm caches.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

from specdec_edge import Pipeline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--method", default="plain")
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--noop", action="store_true")
    args = ap.parse_args()
    import specdec_edge.api.generation as generation
    import specdec_edge.speculative.loop as loop
    from specdec_edge.speculative.acceptance import ExactAcceptance

    pipe = Pipeline.load(args.bundle, method=args.method, threads=args.threads, history=False)
    engine = pipe.engines.target
    acc = dict.fromkeys(("ort", "verify", "rule", "near", "commit", "decode"), 0.0)

    def timer(name, fn):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t0

        return wrapped

    run = engine.session.run_with_iobinding
    if args.noop:  # one real call first, so that the logits the no-op leaves behind are a real row
        pipe.generate([{"role": "user", "content": "Tell me a long story."}], max_new_tokens=4)
    engine.session.run_with_iobinding = timer("ort", (lambda binding: None) if args.noop else run)
    loop.verify = timer("verify", loop.verify)
    loop.near_ties = timer("near", loop.near_ties)
    ExactAcceptance.__call__ = timer("rule", ExactAcceptance.__call__)
    type(engine).commit = timer("commit", type(engine).commit)
    real_decode = generation.decode

    def decode(*a, **k):
        steps = real_decode(*a, **k)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(steps)
            except StopIteration:
                return
            finally:
                acc["decode"] += time.perf_counter() - t0
            yield item

    generation.decode = decode
    text = resources.files("specdec_edge").joinpath("data/spec_bench_question.jsonl").read_text()
    seen, prompts = set(), []
    for row in map(json.loads, text.splitlines()):
        if row["category"] not in seen:
            seen.add(row["category"])
            prompts.append([{"role": "user", "content": row["turns"][0]}])
    sums, total, steps = dict.fromkeys(acc, 0.0), 0.0, 0
    for messages in prompts[: args.n]:
        stream = pipe.stream(messages, max_new_tokens=args.max_new_tokens)
        first = None
        for _ in stream:
            if first is None:  # prefill and the first step are done: count from here
                first, base = time.perf_counter(), dict(acc)
        if first is None:  # nothing streamed (an empty answer)
            continue
        total += time.perf_counter() - first
        steps += stream.result.stats.steps - 1
        for name in acc:
            sums[name] += acc[name] - base[name]
    us = {name: 1e6 * value / steps for name, value in sums.items()}
    parts = {
        "inside ONNX Runtime": us["ort"],
        "engine around it": us["verify"] - us["ort"],
        "acceptance rule": us["rule"],
        "near-tie scan": us["near"],
        "cache commit": us["commit"],
        "rest of the loop": us["decode"] - us["verify"] - us["rule"] - us["near"] - us["commit"],
        "stream consumer": 1e6 * total / steps - us["decode"],
    }
    print(f"{args.method}, {steps} steps{' (run call a no-op)' if args.noop else ''}: us per step")
    for name, value in parts.items():
        print(f"  {name:22s} {value:8.0f}")
    print(f"  {'outside ONNX Runtime':22s} {1e6 * total / steps - us['ort']:8.0f}")


if __name__ == "__main__":
    main()
