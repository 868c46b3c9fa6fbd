"""Restore cost (ms per 1,000 tokens) against prefill on the default gguf bundle; item 1's turn-2 prefill."""

import json
import statistics
import sys
import time

from specdec_edge import Pipeline
from specdec_edge.bench.spec_bench import load_prompts

bundle = sys.argv[1]
pipe = Pipeline.load(bundle, method="plain", threads=2, prompt_cache_mb=512)
docs = [p.turns[0] for p in load_prompts(n_per_category=3) if p.category in ("summarization", "rag")]
docs = sorted(docs, key=len)[-2:]
a = [{"role": "user", "content": docs[0]}]
b = [{"role": "user", "content": docs[1]}]
na, nb = len(pipe.encode(a)), len(pipe.encode(b))
out = {"tokens_a": na, "tokens_b": nb}
pipe.generate(a, max_new_tokens=1, reuse=False)  # warm-up (shapes)
pipe.generate(b, max_new_tokens=1, reuse=False)
fresh = [pipe.generate(a, max_new_tokens=1, reuse=False).stats.prefill_s for _ in range(3)]
out["fresh_prefill_ms_per_1000"] = 1000 * statistics.median(fresh) / (na - 1) * 1000
restores = []
for _ in range(3):
    pipe.generate(b, max_new_tokens=1)  # B: A (held) is snapshotted; B restored or prefilled
    r = pipe.generate(a, max_new_tokens=1)  # A again: restored from its snapshot
    assert r.stats.restored_tokens > 0, r.stats
    restores.append((r.stats.prefill_s, r.stats.restored_tokens))
out["restore_call_prefill_ms_per_1000"] = statistics.median(1e6 * s / n for s, n in restores)
t = pipe.engines.target
n = t.length
times = []
for _ in range(5):
    t0 = time.perf_counter()
    kv = t.snapshot()
    t1 = time.perf_counter()
    t.restore(kv, list(t.held), 0)
    t2 = time.perf_counter()
    times.append((t1 - t0, t2 - t1))
out["snapshot_ms_per_1000"] = statistics.median(1e6 * x / n for x, _ in times)
out["restore_ms_per_1000"] = statistics.median(1e6 * y / n for _, y in times)
out["kv_bytes_per_token"] = int(kv.nbytes / n)
# item 1: turn 2 of a conversation over A
r1 = pipe.generate(a, max_new_tokens=64, reuse=False)
turn2 = [*a, {"role": "assistant", "content": r1.text}, {"role": "user", "content": "List three facts from it."}]
reused = pipe.generate(turn2, max_new_tokens=1)
full = pipe.generate(turn2, max_new_tokens=1, reuse=False)
out["turn2"] = {
    "prompt_tokens": full.stats.prompt_tokens,
    "reused": reused.stats.reused_tokens,
    "prefill_s_reuse": reused.stats.prefill_s,
    "prefill_s_full": full.stats.prefill_s,
    "ratio": reused.stats.prefill_s / full.stats.prefill_s,
}
out["exactness"] = pipe.describe_exactness()
print(json.dumps(out, indent=1))
