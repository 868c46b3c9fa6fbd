"""The Python half of scripts/gpu_check.sh (run that): per backend and bundle, logits agree with the
CPU reference, pld (a chain) and lookahead (a tree) give exactly the plain greedy output, and speeds.

    python scripts/gpu_check.py "cuda tensorrt trt" [MODEL]
"""

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from specdec_edge import Pipeline
from specdec_edge.bundle import read_manifest
from specdec_edge.export.exporter import export_bundle
from specdec_edge.runtime import open_engine

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):",
    "Summarize the following article in three sentences.",
    "Speculative decoding proposes tokens and verifies them in one pass.",
    "héllo wörld, naïve café",
    "The quick brown fox",
]
IDS, VERIFY = [5, 17, 42, 99, 3, 250, 7, 61], [11, 12, 13, 14, 15]
KINDS = {
    "ort-fp32": ("ort", "fp32"),
    "ort-fp16": ("ort", "fp16"),
    "portable-fp32": ("portable", "fp32"),
    "portable-fp16": ("portable", "fp16"),
}


def two_steps(bundle: Path, provider: str, pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Logits of a prefill and of a 5-token verify pass after it."""
    engine = open_engine(bundle, read_manifest(bundle).target.graph, provider=provider, pad_to=pad_to)
    return engine.run(IDS).logits.copy(), engine.run(VERIFY).logits.copy()


def check(backend: str, name: str, pad_to: int | None, bundle: Path, ref, build_s: float | None) -> tuple[tuple, bool]:
    t0 = time.perf_counter()
    first, verify = two_steps(bundle, backend, pad_to)
    err = max(float(np.abs(first - ref[0]).max()), float(np.abs(verify - ref[1]).max())) / float(np.abs(ref[0]).max())
    pipes = {"plain": Pipeline.load(bundle, provider=backend, method="plain", pad_to=pad_to)}
    pipes["pld"] = pipes["plain"].with_method("pld", k=4)
    pipes["lookahead"] = pipes["plain"].with_method("lookahead", k=4)
    load_s = time.perf_counter() - t0
    pipes["plain"].generate(PROMPTS[0], max_new_tokens=8)  # warm-up
    same, times, tokens = {"pld": 0, "lookahead": 0}, dict.fromkeys(pipes, 0.0), dict.fromkeys(pipes, 0)
    for prompt in PROMPTS:
        for method, pipe in pipes.items():
            t0 = time.perf_counter()
            out = pipe.generate(prompt, max_new_tokens=128)
            times[method] += time.perf_counter() - t0
            tokens[method] += len(out.token_ids)
            if method == "plain":
                want = out.token_ids
            elif out.token_ids == want:
                same[method] += 1
    rate = {m: tokens[m] / times[m] for m in times}
    n = len(PROMPTS)
    row = (
        backend,
        name,
        "-" if backend == "cpu" else str(32 if pad_to is None else pad_to),
        f"{load_s if build_s is None else build_s:.1f}",
        f"{err:.1e}",
        f"{same['pld']}/{n}",
        f"{same['lookahead']}/{n}",
        f"{rate['plain']:.1f}",
        f"{rate['pld'] / rate['plain']:.2f}x",
        f"{rate['lookahead'] / rate['plain']:.2f}x",
    )
    return row, all(v == n for v in same.values())


def main() -> int:
    backends, model = sys.argv[1].split(), (sys.argv[2] if len(sys.argv) > 2 else "")
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    if not model:  # random weights in SmolLM2-135M's shape (its vocabulary aside), so speeds are representative
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.tiny_models import make_model

        model = str(
            make_model(
                work / "model",
                "llama",
                layers=30,
                hidden_size=576,
                intermediate_size=1536,
                num_attention_heads=9,
                num_key_value_heads=3,
                max_position_embeddings=2048,
            )
        )
    t0 = time.perf_counter()
    bundles = {
        name: export_bundle(model, work / name, flavour=f, dtype=d, capacity=1024, progress=False)
        for name, (f, d) in KINDS.items()
    }
    print(f"export of {len(bundles)} bundles: {time.perf_counter() - t0:.1f} s", flush=True)
    build = {}
    for b in ("trt", "tensorrt"):
        if b in backends:
            from specdec_edge.export.build_engines import build_engines

            t0 = time.perf_counter()
            try:
                build_engines(bundles["portable-fp16"], backends=(b,), max_verify=16, echo=lambda s: None)
            except Exception as e:  # the load below reports it in the table
                print(f"build-engines --backend {b} failed: {type(e).__name__}: {e}")
            build[b] = time.perf_counter() - t0
    refs = {name: two_steps(bundles[name], "cpu") for name in ("ort-fp32", "portable-fp32")}
    # The CUDA EP has no fp32 GroupQueryAttention, so the engine refuses ort-fp32 there. Each GPU row runs
    # with the default padding (every pass 32 rows) and without it (pad 0), to show what padding buys.
    runs = [("cpu", "ort-fp32", None)]
    runs += [("cuda", name, pad) for name in KINDS if name != "ort-fp32" and "cuda" in backends for pad in (None, 0)]
    runs += [(b, "portable-fp16", pad) for b in ("tensorrt", "trt") if b in backends for pad in (None, 0)]
    rows, ok = [], True
    for b, name, pad in runs:
        ref = refs["ort-fp32" if name.startswith("ort") else "portable-fp32"]
        try:
            row, exact = check(b, name, pad, bundles[name], ref, build.get(b))
        except Exception as e:  # report every backend, then fail
            row, exact = (
                (b, name, str(pad), "-", f"failed: {type(e).__name__}: {str(e)[:300]}", "-", "-", "-", "-", "-"),
                False,
            )
        ok &= exact or pad == 0  # unpadded GPU rows are shown for comparison, not required to be exact
        rows.append(row)
        print("done:", row, flush=True)
    head = (
        "backend",
        "bundle",
        "pad",
        "build/load s",
        "logits err vs cpu fp32",
        "pld == plain",
        "lookahead == plain",
        "plain tok/s",
        "pld speedup",
        "lookahead speedup",
    )
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
