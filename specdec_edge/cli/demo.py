"""`specdec-edge demo`: the default model, plain vs speculative on one prompt, side by side."""

from __future__ import annotations

import json
from importlib import resources

from specdec_edge.api.pipeline import Pipeline
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.export.default_model import DEFAULT_DTYPE, default_bundle
from specdec_edge.progress import to_stderr
from specdec_edge.speculative.methods import default_method

DEFAULT_QUESTION_ID = 241  # a Spec-Bench summarization prompt: answers that copy the input suit prompt lookup


def spec_bench_prompt(question_id: int = DEFAULT_QUESTION_ID) -> str:
    text = resources.files("specdec_edge").joinpath("data/spec_bench_question.jsonl").read_text()
    for line in text.splitlines():
        row = json.loads(line)
        if row["question_id"] == question_id:
            return row["turns"][0]
    raise KeyError(question_id)


def run_demo(
    prompt: str | None = None,
    *,
    method: str | None = None,
    k: int | None = None,
    max_new_tokens: int = 128,
    threads: int | None = None,
    dtype: str = DEFAULT_DTYPE,
    echo=print,
    write=None,
) -> dict:
    """Stream the speculative answer, then time plain decoding on the same prompt; return both stats.

    ``method``: default the bundle's own (auto, unless the bundle records another)."""
    write = write or (lambda text: print(text, end="", flush=True))
    bundle = default_bundle(dtype)
    # it prints anyway; no history: plain runs the same prompt
    pipe = Pipeline.load(bundle, method="plain", threads=threads, progress=to_stderr, history=False)
    manifest = read_manifest(bundle)
    method = method or default_method(manifest.default_method)
    method = "pld" if method == "plain" else method  # a bundle that records nothing: show prompt lookup
    spec = pipe.with_method(method, k=k)
    messages = [{"role": "user", "content": prompt or spec_bench_prompt()}]
    echo(f"Bundle: {bundle}")
    echo(f"Prompt ({len(pipe.encode(messages))} tokens): {messages[0]['content'][:160]}...")
    # Untimed: the first call after loading also sets up what only it pays for (the prefill runtime's session and
    # its check against the target graph, the head's session, ONNX Runtime's buffers for these shapes).
    spec.generate(messages, max_new_tokens=8, reuse=False)
    echo(f"\n--- {method} (k={spec.k}), streamed ---")
    for piece in (stream := spec.stream(messages, max_new_tokens=max_new_tokens, reuse=False)):
        write(piece)
    fast = stream.result
    slow = pipe.generate(messages, max_new_tokens=max_new_tokens, reuse=False)  # a fresh prefill, as fast had
    speedup = fast.stats.tokens_per_s / slow.stats.tokens_per_s if slow.stats.tokens_per_s else float("nan")
    same = fast.token_ids == slow.token_ids
    echo("\n\n--- result ---")
    echo(
        f"plain:   {slow.stats.tokens_per_s:6.1f} tok/s ({slow.stats.decode_tokens_per_s:.1f} after a "
        f"{slow.stats.prefill_s:.2f} s prefill)"
    )
    echo(
        f"{method}: {' ' * max(0, 6 - len(method))}{fast.stats.tokens_per_s:6.1f} tok/s "
        f"({fast.stats.decode_tokens_per_s:.1f} after prefill), {fast.stats.tokens_per_pass:.2f} tokens per target pass"
    )
    if len(fast.stats.by_proposer) > 1:
        echo(f"proposers: {fast.stats.proposer_summary()}")
    identical = "yes" if same else "NO"
    echo(f"speedup {speedup:.2f}x, output identical to plain: {identical} (both timed after one untimed call)")
    return {"speedup": speedup, "identical": same, "plain": slow.stats.as_dict(), method: fast.stats.as_dict()}
