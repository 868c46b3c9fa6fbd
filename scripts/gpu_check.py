"""The Python half of scripts/gpu_check.sh (run that). Sections, each written to OUT as soon as it is done,
most decisive first, so that a run cut short still leaves its results:

1. trt_rtx.md: a TensorRT-RTX engine built for this GPU (or the exact refusal), one built ahead of time for an RTX
   GPU (8.9) and loaded here, and, where this GPU is supported, the engine's exactness and speed.
2. cuda_graphs.md: plain greedy decoding in ms per token on the CUDA EP (fp16 ``ort`` bundle), without and with
   CUDA graphs, and whether the tokens are the same.
3. bench_real.md/.json (MODEL given: the SmolLM2 GGUF): the real checkpoint in fp16 with the shipped EAGLE head
   on the CUDA EP with CUDA graphs, plain / pld / eagle (wider tree) / lookahead / auto over 26 Spec-Bench
   prompts (auto: which proposer, width and tree it chooses from the GPU's measured pass costs).
   chain_ceiling.md: from the pass costs auto measured there, what a drafted chain can gain by its acceptance
   (benchmarks/chain_ceiling.py; on a 2-core CPU a verify row costs ~20 % of a pass, docs/PERFORMANCE.md).
4. backends.md: per backend and bundle kind, logits against the CPU reference, pld (a chain) and lookahead (a
   tree) == plain greedy output, and speeds (random weights in SmolLM2-135M's shape).

    python scripts/gpu_check.py "cuda tensorrt trt trt-rtx" OUT [MODEL [TABLE_MODEL]]

MODEL: the real checkpoint of section 3 (a .gguf or HF folder). TABLE_MODEL: what sections 1, 2 and 4 export
(default: random weights in SmolLM2-135M's shape, made here).
"""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from specdec_edge import Pipeline
from specdec_edge.bench.spec_bench import load_prompts, run_bench, to_markdown
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.export.default_model import SHIPPED_HEADS
from specdec_edge.export.exporter import export_bundle
from specdec_edge.export.sources import cache_limits
from specdec_edge.runtime.base import GpuOptions
from specdec_edge.runtime.factory import open_engine

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
ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-c", "from specdec_edge.cli import main; main()"]


def table(head: tuple, rows: list) -> str:
    return "\n".join(
        ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    )


def write(out: Path, name: str, text: str) -> None:
    (out / name).write_text(text + "\n")
    print(f"\n== {name}\n{text}", flush=True)


def two_steps(bundle: Path, provider: str, pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Logits of a prefill and of a 5-token verify pass after it."""
    engine = open_engine(bundle, read_manifest(bundle).target.graph, provider=provider, gpu=GpuOptions(pad_to=pad_to))
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


def plain_decode(bundle: Path, cuda_graph: bool, steps: int = 256) -> tuple[float, list[int], str]:
    """Greedy plain decoding step by step on the CUDA EP: median ms per token (after 16 warm-up steps), the
    tokens, and how many passes ran as the fixed-shape (graph) pass."""
    engine = open_engine(
        bundle, read_manifest(bundle).target.graph, provider="cuda", gpu=GpuOptions(cuda_graph=cuda_graph)
    )
    token = int(np.argmax(engine.run(IDS, logits_to_keep=1).logits[-1]))
    engine.commit(len(IDS))
    tokens, times = [token], []
    for _ in range(steps):
        t0 = time.perf_counter()
        token = int(np.argmax(engine.run([token]).logits[-1]))
        engine.commit(1)
        times.append(time.perf_counter() - t0)
        tokens.append(token)
    return 1000 * float(np.median(times[16:])), tokens, f"{engine.fixed_passes}/{engine.passes}"


def cuda_graph_rows(name: str, bundle: Path) -> list[tuple]:
    rows = []
    try:
        base_ms, base_tokens, _ = plain_decode(bundle, False)
        graph_ms, graph_tokens, fixed = plain_decode(bundle, True)
        pipe = Pipeline.load(bundle, provider="cuda", method="plain")
        graph_pipe = Pipeline.load(bundle, provider="cuda", method="plain", cuda_graph=True)
        same = sum(
            pipe.generate(p, max_new_tokens=64).token_ids == graph_pipe.generate(p, max_new_tokens=64).token_ids
            for p in PROMPTS
        )
        rows.append(
            (
                name,
                f"{base_ms:.2f}",
                f"{graph_ms:.2f}",
                f"{base_ms / graph_ms:.2f}x",
                "yes" if base_tokens == graph_tokens else "NO",
                f"{same}/{len(PROMPTS)}",
                fixed,
            )
        )
    except Exception as e:  # report it in the table and go on
        rows.append((name, "-", f"failed: {type(e).__name__}: {str(e)[:400]}", "-", "-", "-", "-"))
    return rows


def trt_rtx_section(bundle: Path, work: Path) -> tuple[str, bool]:
    """Build for this GPU (the exact refusal if TensorRT-RTX does not support it); build ahead of time for an RTX
    40xx (8.9) and try to load that here. Returns the text and whether the engine for this GPU was built."""
    import tensorrt_rtx

    from specdec_edge.runtime.prebuilt import gpu_info

    gpu = gpu_info()
    lines = [
        f"TensorRT-RTX {tensorrt_rtx.__version__} on {gpu['name']} (compute capability {gpu['compute_capability']})"
    ]
    built = False
    for label, extra in (("for this GPU (CURRENT)", []), ("ahead of time for 8.9", ["--compute-capability", "8.9"])):
        copy = work / f"rtx-{len(extra)}"
        subprocess.run(["cp", "-r", str(bundle), str(copy)], check=True)
        t0 = time.perf_counter()
        args = [*CLI, "build-engines", str(copy), "--backend", "trt-rtx", "--max-verify", "16", *extra]
        res = subprocess.run(args, capture_output=True, text=True, timeout=300)
        said = (res.stdout + res.stderr).strip().splitlines()
        lines.append(f"\nbuild {label}: exit {res.returncode} in {time.perf_counter() - t0:.1f} s")
        lines += ["    " + line for line in said[-12:]]
        if res.returncode == 0:
            load = [*CLI, "generate", str(copy), "--provider", "trt-rtx", "--method", "plain", "--prompt", "Hello"]
            res = subprocess.run([*load, "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300)
            lines.append(f"load + generate 8 tokens with provider trt-rtx: exit {res.returncode}")
            lines += ["    " + line for line in (res.stdout + res.stderr).strip().splitlines()[-8:]]
            built |= not extra and res.returncode == 0
    return "```\n" + "\n".join(lines) + "\n```", built


def main() -> int:
    backends, out = sys.argv[1].split(), Path(sys.argv[2])
    model, table_model = (sys.argv[3:] + ["", ""])[:2]
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    if not table_model:  # random weights in SmolLM2-135M's shape (its vocabulary aside): representative speeds
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.tiny_models import make_model

        shape = dict(layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
        table_model = str(make_model(work / "model", "llama", max_position_embeddings=2048, **shape))
    t0 = time.perf_counter()
    capacity = min(1024, cache_limits(table_model)[0] or 1024)  # export refuses more than the model's positions
    bundles = {
        name: export_bundle(table_model, work / name, flavour=f, dtype=d, capacity=capacity, progress=False)
        for name, (f, d) in KINDS.items()
    }
    print(f"export of {len(bundles)} bundles: {time.perf_counter() - t0:.1f} s", flush=True)
    ok = True

    # 1. TensorRT-RTX
    if "trt-rtx" in backends:
        text, rtx_built = trt_rtx_section(bundles["portable-fp16"], work)
        write(out, "trt_rtx.md", text)
        if not rtx_built:
            backends = [b for b in backends if b != "trt-rtx"]

    # 2. CUDA graphs, random weights (and 3. the real checkpoint, which adds its own row)
    head = ("bundle", "plain ms/token", "with CUDA graphs", "speedup", "same 256 tokens", "same 64 x 6", "graph passes")
    if "cuda" in backends:
        rows = cuda_graph_rows(f"{Path(table_model).name}, ort fp16, capacity {capacity}", bundles["ort-fp16"])
        write(out, "cuda_graphs.md", table(head, rows))
        if model:
            t0 = time.perf_counter()
            heads = (str(SHIPPED_HEADS / "eagle"),)
            real = export_bundle(model, work / "real-fp16", dtype="fp16", heads=heads, progress=False)
            print(f"export of {model} (fp16, eagle head): {time.perf_counter() - t0:.1f} s", flush=True)
            rows += cuda_graph_rows(f"{Path(model).name}, ort fp16, capacity 2048", real)
            write(out, "cuda_graphs.md", table(head, rows))
            pipe = Pipeline.load(real, provider="cuda", method="plain", cuda_graph=True)
            options = {"eagle": {"topk": 4, "nodes": 16, "depth": 6}}
            methods = ["plain", "pld", "eagle", "lookahead", "auto"]  # auto: its choices under the GPU's costs
            report = run_bench(pipe, methods, load_prompts(), options=options, progress=False)
            (out / "bench_real.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
            write(
                out,
                "bench_real.md",
                f"eagle options {options['eagle']}; provider cuda, CUDA graphs\n\n{to_markdown(report)}",
            )
            script = ROOT / "benchmarks" / "chain_ceiling.py"
            ceiling = subprocess.run([sys.executable, str(script), str(real)], capture_output=True, text=True)
            write(out, "chain_ceiling.md", ceiling.stdout + ceiling.stderr)

    # 4. every backend against the CPU
    build = {}
    for b in ("trt", "tensorrt", "trt-rtx"):
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
    runs += [(b, "portable-fp16", pad) for b in ("tensorrt", "trt", "trt-rtx") if b in backends for pad in (None, 0)]
    rows = []
    for b, name, pad in runs:
        ref = refs["ort-fp32" if name.startswith("ort") else "portable-fp32"]
        try:
            row, exact = check(b, name, pad, bundles[name], ref, build.get(b))
        except Exception as e:  # report every backend, then fail
            row, exact = ((b, name, str(pad), "-", f"failed: {type(e).__name__}: {str(e)[:300]}", *"-----"), False)
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
    write(out, "backends.md", table(head, rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
