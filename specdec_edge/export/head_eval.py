"""How well a heads folder drafts on a bundle, measured by running it there: the number users get.

``chain_acceptance`` adds the heads to a copy of ``bundle`` (``add_heads``), answers held-out prompts greedily
with the head's method as a chain ``depth`` tokens deep, and reads the accepted lengths of every pass. A chain's
first ``d`` drafted tokens do not depend on how deep it goes on, so one run at depth 4 gives the mean accepted
length at every depth ``d <= 4``: E[min(accepted, d)]; the first token's top-1 is P(accepted >= 1).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path


def chain_acceptance(
    heads: Path, bundle: Path, prompts: list[str], *, method: str = "eagle", depth: int = 4, max_new_tokens: int = 96,
    threads: int | None = None,
) -> dict:  # fmt: skip
    """{"top1", "accepted_at_depth": {d: mean accepted}, "tokens_per_pass", "passes", "prompts"} on ``bundle``."""
    from specdec_edge.api.pipeline import Pipeline
    from specdec_edge.export.head_export import add_heads

    lengths: Counter = Counter()
    new_tokens = steps = 0
    with tempfile.TemporaryDirectory(prefix="specdec-head-eval-") as tmp:
        scored = add_heads(bundle, [heads], Path(tmp) / "bundle")
        with Pipeline.load(scored, method=method, k=depth, threads=threads, history=False, prompt_cache_mb=0) as pipe:
            for text in prompts:
                r = pipe.generate([{"role": "user", "content": text}], max_new_tokens, reuse=False, history=False)
                lengths.update(r.stats.accepted_lengths)
                new_tokens, steps = new_tokens + r.stats.new_tokens, steps + r.stats.steps
    passes = sum(lengths.values()) or 1
    at = {d: sum(min(a, d) * n for a, n in lengths.items()) / passes for d in range(1, depth + 1)}
    return {
        "top1": sum(n for a, n in lengths.items() if a >= 1) / passes,
        "accepted_at_depth": {d: round(v, 3) for d, v in at.items()},
        "tokens_per_pass": round(new_tokens / max(steps, 1), 3),
        "passes": passes,
        "prompts": len(prompts),
    }
