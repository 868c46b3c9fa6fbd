"""`specdec-edge demo`: the default model, plain vs speculative on four prompts (or yours), side by side."""

from __future__ import annotations

import json
from importlib import resources

from specdec_edge.api.pipeline import Pipeline
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.export.default_model import DEFAULT_DTYPE, default_bundle
from specdec_edge.progress import to_stderr
from specdec_edge.speculative.methods import default_method

# Spec-Bench first turns the demo answers when no prompt is given, one of each kind of call: open writing (the head
# drafts), a question over a long passage (the answer draws on it: prompt lookup), and a long article to summarize
# (a 769-token prompt: prefill is much of the call, and speculation gains least there).
DEMO_QUESTIONS = (81, 481, 241)
# And an edit of a given text, written for this demo: the answer copies most of its prompt, which is where
# speculation pays most (prompt lookup's chains run long; docs/PERFORMANCE.md, "Where speculation pays").
DEMO_EDIT = (
    "Proofread this email and return it with the mistakes fixed:\n\n"
    "Hi team, I wanted to give a quick update on the projet. We have finished the first version of the app and it is "
    "now avaliable for testing on the staging server. Please try the new search page, the settings screen and the "
    "export button, and write down anything that looks wrong or feels slow. The login page still has a bug where the "
    "password field dont clear after a failed attempt; Sam is working on a fix and expects to have it ready by "
    "thursday. We will meet on friday at 10am to go through the feedback and decide what goes into the next release. "
    "Thanks for all the hard work this month, and let me know if you have any questions."
)


def spec_bench_row(question_id: int) -> dict:
    """The packaged Spec-Bench row of ``question_id``."""
    text = resources.files("specdec_edge").joinpath("data/spec_bench_question.jsonl").read_text()
    for line in text.splitlines():
        row = json.loads(line)
        if row["question_id"] == question_id:
            return row
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
    """Answer ``prompt`` (default: the three ``DEMO_QUESTIONS`` and ``DEMO_EDIT``) speculatively, streaming the first
    answer, and time plain decoding on the same prompts; print both and return their stats.

    ``method``: default the bundle's own (auto, unless the bundle records another)."""
    write = write or (lambda text: print(text, end="", flush=True))
    bundle = default_bundle(dtype)
    # it prints anyway; no history: plain runs the same prompt
    pipe = Pipeline.load(bundle, method="plain", threads=threads, progress=to_stderr, history=False)
    manifest = read_manifest(bundle)
    method = method or default_method(manifest.default_method)
    method = "pld" if method == "plain" else method  # a bundle that records nothing: show prompt lookup
    spec = pipe.with_method(method, k=k)
    if prompt:
        prompts = [("", prompt)]
    else:
        prompts = [(row["category"], row["turns"][0]) for row in map(spec_bench_row, DEMO_QUESTIONS)]
        prompts.append(("edit", DEMO_EDIT))
    echo(f"Bundle: {bundle}")
    # Untimed: what only a first call pays for (the prefill runtime's compile and its check against the target graph,
    # which a first long prompt would wait for; the head's session; ONNX Runtime's buffers for these shapes).
    pipe.warm_up()
    spec.generate([{"role": "user", "content": prompts[0][1]}], max_new_tokens=8, reuse=False)
    rows = []
    for i, (label, text) in enumerate(prompts):
        messages = [{"role": "user", "content": text}]
        where = f" {i + 1} of {len(prompts)}, {label}" if label else ""
        echo(f"\nPrompt{where} ({len(pipe.encode(messages))} tokens): {text[:160]}...")
        if i == 0:
            echo(f"\n--- {method} (k={spec.k}), streamed ---")
            for piece in (stream := spec.stream(messages, max_new_tokens=max_new_tokens, reuse=False)):
                write(piece)
            echo("")
            fast = stream.result
        else:
            fast = spec.generate(messages, max_new_tokens=max_new_tokens, reuse=False)
        slow = pipe.generate(messages, max_new_tokens=max_new_tokens, reuse=False)  # a fresh prefill, as fast had
        rows.append((label or "your prompt", fast, slow))
    return _report(rows, method, echo)


def _rate(results) -> float:
    """Tokens per second over ``results``' calls together (whole calls: prefill included)."""
    seconds = sum(r.stats.total_s for r in results)
    return sum(r.stats.new_tokens for r in results) / seconds if seconds > 0 else float("nan")


def _report(rows: list, method: str, echo) -> dict:
    """The result lines of ``rows`` ((label, speculative result, plain result) each) and the returned dict."""
    echo("\n--- result ---")
    pad = "  " if len(rows) > 1 else ""  # several prompts: each one's lines under its name
    for label, fast, slow in rows:
        if pad:
            echo(f"{label}:")
        echo(
            f"{pad}plain:   {slow.stats.tokens_per_s:6.1f} tok/s ({slow.stats.decode_tokens_per_s:.1f} after a "
            f"{slow.stats.prefill_s:.2f} s prefill)"
        )
        echo(
            f"{pad}{method}: {' ' * max(0, 6 - len(method))}{fast.stats.tokens_per_s:6.1f} tok/s "
            f"({fast.stats.decode_tokens_per_s:.1f} after prefill), {fast.stats.tokens_per_pass:.2f} tokens per "
            f"target pass: {_rate([fast]) / _rate([slow]):.2f}x"
        )
        if len(fast.stats.by_proposer) > 1:
            echo(f"{pad}proposers: {fast.stats.proposer_summary()}")
    same = [fast.token_ids == slow.token_ids for _, fast, slow in rows]
    speedup = _rate([fast for _, fast, _ in rows]) / _rate([slow for _, _, slow in rows])
    over = f" over the {len(rows)} prompts (whole calls, prefill included)" if len(rows) > 1 else ""
    identical = "yes" if all(same) else "NO"
    count = f" ({sum(same)} of {len(rows)})" if len(rows) > 1 else ""
    echo(f"speedup {speedup:.2f}x{over}, output identical to plain: {identical}{count} (timed after one untimed call)")
    prompts = [
        {"prompt": label, "identical": ok, "plain": slow.stats.as_dict(), method: fast.stats.as_dict()}
        for (label, fast, slow), ok in zip(rows, same)
    ]
    return {"speedup": speedup, "identical": all(same), "prompts": prompts}
