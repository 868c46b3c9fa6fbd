"""Share of decode time spent outside ONNX Runtime calls (the loop's own overhead).

Usage:
  python benchmarks/loop_overhead.py BUNDLE --method draft --k 4 --n 6 --max-new-tokens 128

Times every ``InferenceSession.run_with_iobinding`` of the target and draft engines, and every run of the
bundle's trained heads (EAGLE, Medusa: ``session.run``, reported apart); the rest of the decode time (after
prefill) is the loop: proposing, acceptance, cache bookkeeping, detokenization, stop handling.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

from specdec_edge import Pipeline


def timed(session, bucket: list, name: str = "run_with_iobinding"):
    run = getattr(session, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            bucket[0] += time.perf_counter() - t0

    wrapper.__wrapped__ = run
    setattr(session, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--method", default="draft")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--n", type=int, default=6, help="prompts (Spec-Bench, first of each category)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    pipe = Pipeline.load(args.bundle, method=args.method, k=args.k, threads=args.threads, history=False)
    inside = [0.0]
    for engine in filter(None, (pipe.engines.target, pipe.engines.draft)):
        timed(engine.session, inside)
    heads = [0.0]
    for head in pipe.engines.heads.values():
        timed(head.session, heads, "run")
    rows = [
        json.loads(x)
        for x in resources.files("specdec_edge").joinpath("data/spec_bench_question.jsonl").read_text().splitlines()
    ]
    seen, prompts = set(), []
    for r in rows:
        if r["category"] not in seen:
            seen.add(r["category"])
            prompts.append([{"role": "user", "content": r["turns"][0]}])
    decode_s = ort_s = head_s = 0.0
    tokens = passes = 0
    for messages in prompts[: args.n]:
        stream = pipe.stream(messages, max_new_tokens=args.max_new_tokens)
        first = None
        for _ in stream:
            if first is None:  # prefill and the first step are done: count from here
                first = (time.perf_counter(), inside[0], heads[0])
        end = (time.perf_counter(), inside[0], heads[0])
        decode_s += end[0] - first[0]
        ort_s += end[1] - first[1]
        head_s += end[2] - first[2]
        tokens += stream.result.stats.new_tokens
        passes += stream.result.stats.steps
    loop_s = decode_s - ort_s - head_s
    print(
        f"method {args.method} k={args.k}: {tokens} tokens in {passes} target passes, decode {decode_s:.2f} s, "
        f"inside ONNX Runtime {ort_s:.2f} s (+ heads {head_s:.2f} s = {100 * head_s / decode_s:.1f} %), "
        f"outside {loop_s:.3f} s = {100 * loop_s / decode_s:.1f} %"
    )
    raw = raw_pass_ms(pipe.engines.target)
    print(
        f"decode {1e3 * decode_s / tokens:.2f} ms a token, {1e3 * ort_s / passes:.2f} ms inside ONNX Runtime a pass; "
        f"the last pass's binding run alone: {raw:.2f} ms (least of 5 x 20) -> a step is "
        f"{1e3 * decode_s / passes / raw:.2f}x the raw pass"
    )


def raw_pass_ms(engine, rounds: int = 5, reps: int = 20) -> float:
    """The target's last pass run again on its own binding (the same shape, at the last context): the raw pass,
    with nothing of the loop or the engine around it. Each run writes the same (uncommitted) slots."""
    run = getattr(engine.session.run_with_iobinding, "__wrapped__", engine.session.run_with_iobinding)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            run(engine.binding)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 1e3 * best


if __name__ == "__main__":
    main()
