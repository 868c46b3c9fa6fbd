"""Soak: many generate and stream calls on one loaded bundle from several threads, each with a deadline.

Usage:
  python benchmarks/soak.py BUNDLE --calls 1000 --threads 8 --max-new-tokens 24 --json soak.json

Every method the bundle can run shares the loaded engines (``Pipeline.with_method``); the calls are a
seeded random mix: half ``generate``, half streams, greedy and sampled. A quarter of the streams are
dropped or cancelled midway (dropped: the reader stops reading; cancelled: ``cancel()`` from the
reading thread or from another one), and a tenth are read slower than the engines' lease, so other
calls run in between and the stream resumes. A few calls carry bad input on purpose and must raise
``SpecdecError``. Checks (exit status 1 when one fails):

* no call exceeds ``--deadline`` seconds (a hang; the stacks of all threads are printed);
* no exception except the expected ``SpecdecError``s;
* every greedy output equals the same call run alone beforehand in one thread (a dropped or cancelled
  stream: what it got is a prefix of it); each that does not is printed, with how often it resumed. With
  ``--no-reuse`` (and ``--prompt-cache-mb 0``) every resumed call rebuilds its context itself, which is what
  showed that a resume must not prefill what the call emitted (docs/lab/serving.md, 2026-12-06); with KV reuse
  and no prompt cache a call's output follows what earlier calls left in the cache (reuse's contract), so the
  references need not hold there;
* resident memory grows less than ``--max-rss-growth`` from call ``--rss-from`` to the last call.

``run_soak`` is the library form; tests/api/test_soak.py runs a short one on a tiny bundle.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import queue
import random
import resource
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from specdec_edge import Pipeline, SpecdecError
from specdec_edge.api.generation import LEASE_S
from specdec_edge.bench.spec_bench import load_prompts
from specdec_edge.speculative.methods import available_methods


@dataclass
class Call:
    """One call of the schedule and what became of it."""

    index: int
    method: str
    prompt: int
    kind: str  # generate | stream | dropped | cancelled | cancelled-elsewhere | slow | bad
    max_new_tokens: int
    sampling: dict = field(default_factory=dict)  # temperature, top_p, seed (empty: greedy)
    token_ids: list | None = None
    finish: str | None = None
    resumes: int = 0
    seconds: float = 0.0
    error: str | None = None


def rss_bytes() -> int:
    """Resident memory of this process now (Linux: /proc; elsewhere the peak, which only grows)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def schedule(calls: int, methods: list[str], prompts: int, max_new_tokens: int, seed: int) -> list[Call]:
    """The calls in a seeded random order, the kinds in fixed proportions: 2 % bad input, then half
    ``generate`` and half streams; of the streams an eighth dropped, a sixteenth cancelled by their reader and
    a sixteenth from another thread (a quarter in all), a tenth read slowly, the rest read to the end."""
    rng = random.Random(seed)
    bad = max(1, calls // 50)
    streams = (calls - bad) // 2
    dropped, cancelled, elsewhere, slow = streams // 8, streams // 16, streams // 16, streams // 10
    kinds = (
        ["bad"] * bad
        + ["generate"] * (calls - bad - streams)
        + ["dropped"] * dropped
        + ["cancelled"] * cancelled
        + ["cancelled-elsewhere"] * elsewhere
        + ["slow"] * slow
        + ["stream"] * (streams - dropped - cancelled - elsewhere - slow)
    )
    rng.shuffle(kinds)
    out = []
    for i, kind in enumerate(kinds):
        sampling = {}
        if rng.random() < 0.3:
            sampling = {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(1 << 16)}
        n = rng.choice((max(1, max_new_tokens // 2), max_new_tokens))
        out.append(Call(i, rng.choice(methods), rng.randrange(prompts), kind, n, sampling))
    return out


def run_call(call: Call, pipe: Pipeline, messages: list[dict], rng: random.Random) -> None:
    """Make one call; fill in what it produced (``call.error`` for an exception)."""
    if call.kind == "bad":
        too_long = pipe.engines.capacity + 1
        try:
            if call.index % 2:
                pipe.generate(messages, max_new_tokens=too_long)
            else:
                pipe.stream(messages, max_new_tokens=call.max_new_tokens, temperature=-1.0)
            call.error = "no error on bad input"
        except SpecdecError:
            call.finish = "refused"
        return
    if call.kind == "generate":
        result = pipe.generate(messages, max_new_tokens=call.max_new_tokens, **call.sampling)
    else:
        stream = pipe.stream(messages, max_new_tokens=call.max_new_tokens, **call.sampling)
        result, read = stream.result, 0
        stop_after = rng.randint(1, 3)
        if call.kind == "cancelled-elsewhere":
            threading.Timer(rng.uniform(0.0, 0.05), stream.cancel).start()
        for _ in stream:
            read += 1
            if call.kind == "slow" and read <= 2:
                time.sleep(LEASE_S * 1.2)  # slower than the lease: other calls may run before the next piece
            if call.kind in ("dropped", "cancelled") and read >= stop_after:
                break
        if call.kind == "cancelled":
            stream.cancel()
            list(stream)  # what is left after a cancel: nothing more is generated
        del stream  # dropped streams are simply forgotten
    call.token_ids, call.finish, call.resumes = list(result.token_ids), result.finish_reason, result.stats.resumes


def run_soak(
    bundle,
    *,
    calls: int = 1000,
    threads: int = 8,
    max_new_tokens: int = 24,
    prompt_chars: int = 400,
    deadline_s: float = 120.0,
    rss_from: int = 200,
    max_rss_growth: float = 0.05,
    ort_threads: int | None = None,
    seed: int = 0,
    reuse: bool = True,
    prompt_cache_mb: float | None = None,
    log=print,
) -> dict:
    """Run the soak (see the module docstring); returns the report, whose ``ok`` says whether every check held."""
    start = time.perf_counter()
    base = Pipeline.load(bundle, method="plain", threads=ort_threads, reuse=reuse, prompt_cache_mb=prompt_cache_mb)
    pipes, skipped = {}, {}
    for name in available_methods(base.engines.draft is not None, base.engines.heads):
        try:
            pipes[name] = base.with_method(name)
        except SpecdecError as e:  # e.g. a tree method on a quantized bundle
            skipped[name] = str(e)
    texts = [p.turns[0][:prompt_chars] for p in load_prompts(None, None, 1)][:8]
    prompts = [[{"role": "user", "content": t}] for t in texts]
    plan = schedule(calls, list(pipes), len(prompts), max_new_tokens, seed)

    # Greedy references: each greedy (method, prompt, length) alone, in this thread, before the soak.
    reference = {}
    for c in plan:
        key = (c.method, c.prompt, c.max_new_tokens)
        if not c.sampling and c.kind != "bad" and key not in reference:
            reference[key] = pipes[c.method].generate(prompts[c.prompt], max_new_tokens=c.max_new_tokens).token_ids
    log(f"{len(reference)} greedy references in {time.perf_counter() - start:.0f} s; methods {', '.join(pipes)}")

    todo: queue.Queue = queue.Queue()
    for c in plan:
        todo.put(c)
    active: dict[int, float] = {}
    lock = threading.Lock()
    done = [0]
    rss: dict[int, int] = {}
    milestones = {rss_from, calls, *range(100, calls + 1, 100)}
    gate = threading.Event()  # closed while memory is measured at call rss_from: no call in flight then
    gate.set()

    def measure(n: int) -> None:
        gc.collect()
        rss[n] = rss_bytes()
        log(f"  {n} calls, RSS {rss[n] / 1e6:.1f} MB" + (" (no call in flight)" if n in (rss_from, calls) else ""))

    def worker(n: int) -> None:
        rng = random.Random(seed * 1000 + n)
        while True:
            gate.wait()
            try:
                c = todo.get_nowait()
            except queue.Empty:
                return
            with lock:
                active[c.index] = time.perf_counter()
            t0 = time.perf_counter()
            try:
                run_call(c, pipes[c.method], prompts[c.prompt], rng)
            except Exception as e:  # counted as unexpected below
                c.error = f"{type(e).__name__}: {e}"
            c.seconds = time.perf_counter() - t0
            with lock:
                del active[c.index]
                done[0] += 1
                count = done[0]
                if count == rss_from:
                    gate.clear()  # the two points compared are both measured with nothing in flight
            if count == rss_from:
                while True:
                    with lock:
                        if not active:
                            break
                    time.sleep(0.01)
                measure(count)
                gate.set()
            elif count in milestones:
                with lock:
                    measure(count)  # the last call's: nothing else is in flight any more

    soak_start = time.perf_counter()
    workers = [threading.Thread(target=worker, args=(n,), daemon=True, name=f"soak-{n}") for n in range(threads)]
    for w in workers:
        w.start()
    hung = []
    while any(w.is_alive() for w in workers):
        time.sleep(0.2)
        with lock:
            hung = [i for i, t in active.items() if time.perf_counter() - t > deadline_s]
        if hung:
            log(f"calls {hung} passed their {deadline_s:.0f} s deadline; stacks of every thread:")
            faulthandler.dump_traceback(sys.stderr)
            break
    soak_s = time.perf_counter() - soak_start

    finished = [c for c in plan if c.seconds > 0]
    unexpected = [f"call {c.index} ({c.method}, {c.kind}): {c.error}" for c in finished if c.error]
    greedy = [c for c in finished if not c.sampling and c.kind != "bad" and not c.error]
    mismatched = []
    for c in greedy:
        want = reference[(c.method, c.prompt, c.max_new_tokens)]
        partial = c.kind in ("dropped", "cancelled", "cancelled-elsewhere")
        if c.token_ids != want and not (partial and want[: len(c.token_ids)] == c.token_ids):
            mismatched.append(c.index)
            first = next((i for i, (a, b) in enumerate(zip(c.token_ids, want)) if a != b), len(c.token_ids))
            log(f"call {c.index} ({c.method}, {c.kind}, resumed {c.resumes}x) differs from its reference at {first}")
    growth = (rss[calls] - rss[rss_from]) / rss[rss_from] if rss_from in rss and calls in rss else None
    latencies = sorted(c.seconds for c in finished if c.kind != "bad")
    report = {
        "bundle": str(bundle),
        "calls": calls,
        "finished": len(finished),
        "threads": threads,
        "methods": list(pipes),
        "skipped_methods": skipped,
        "kinds": dict(Counter(c.kind for c in plan)),
        "sampled": sum(bool(c.sampling) for c in plan),
        "hangs": hung,
        "unexpected_errors": unexpected,
        "expected_errors": sum(c.finish == "refused" for c in finished),
        "greedy_compared": len(greedy),
        "greedy_mismatched": mismatched,
        "cancelled": sum(c.finish == "cancelled" for c in finished),
        "resumed_calls": sum(c.resumes > 0 for c in finished),
        "resumes": sum(c.resumes for c in finished),
        "new_tokens": sum(len(c.token_ids or ()) for c in finished),
        "soak_s": soak_s,
        "latency_s": {q: latencies[int(q * (len(latencies) - 1))] for q in (0.5, 0.9, 0.99, 1.0)} if latencies else {},
        "rss_mb": {n: rss[n] / 1e6 for n in sorted(rss)},
        "rss_growth": growth,
        "rss_window": [rss_from, calls],
    }
    report["ok"] = (
        not hung
        and not unexpected
        and not mismatched
        and len(finished) == calls
        and growth is not None
        and growth < max_rss_growth
    )
    base.close()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=8, help="Threads making calls.")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--prompt-chars", type=int, default=400, help="Each prompt's first characters.")
    ap.add_argument("--deadline", type=float, default=120.0, help="Seconds a call may take before it is a hang.")
    ap.add_argument("--rss-from", type=int, default=200, help="Memory growth is measured from this call to the last.")
    ap.add_argument("--max-rss-growth", type=float, default=0.05)
    ap.add_argument("--ort-threads", type=int, default=None, help="ONNX Runtime CPU threads (default: per core).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-reuse", dest="reuse", action="store_false", help="No KV reuse: every call and resume prefills its prompt."
    )
    ap.add_argument("--prompt-cache-mb", type=float, default=None, help="The prompt cache's limit (0: none).")
    ap.add_argument("--json", default=None, help="Write the report here.")
    args = ap.parse_args()
    report = run_soak(
        args.bundle,
        calls=args.calls,
        threads=args.threads,
        max_new_tokens=args.max_new_tokens,
        prompt_chars=args.prompt_chars,
        deadline_s=args.deadline,
        rss_from=args.rss_from,
        max_rss_growth=args.max_rss_growth,
        ort_threads=args.ort_threads,
        seed=args.seed,
        reuse=args.reuse,
        prompt_cache_mb=args.prompt_cache_mb,
    )
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
