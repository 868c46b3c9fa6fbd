"""One thread-pool setup for every CPU session of the process (runtime/threads.py).

Each case runs in a fresh Python process: ONNX Runtime's process-wide pool is made at most once
per process, so the test process itself (whose pool earlier tests already made) cannot show it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from specdec_edge import Pipeline

PRELUDE = """
import json, os, sys
import onnxruntime as ort
from specdec_edge import Pipeline
from specdec_edge.runtime.threads import PROCESS_POOL

def threads():
    return len(os.listdir("/proc/self/task"))

def pooled(pipe):  # every session of the pipeline, and whether it uses the process-wide pool
    sessions = [pipe.engines.target.session, *([pipe.engines.draft.session] if pipe.engines.draft else []),
                *(h.session for h in pipe.engines.heads.values())]
    return [not s.get_session_options().use_per_session_threads for s in sessions]
"""


def run(code: str, *args) -> dict:
    res = subprocess.run([sys.executable, "-c", PRELUDE + code, *map(str, args)], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_heads_and_draft_bundles_share_one_spinning_pool_and_create_its_threads_once(tiny_bundle, heads_bundle):
    out = run(
        """
before = threads()
# ONNX Runtime's sessions only: OpenVINO's prefill (runtime/ov_prefill.py) keeps a pool of its own
a = Pipeline.load(sys.argv[1], method="pld-eagle", threads=3, prefill="onnxruntime")   # target + EAGLE + Medusa heads
b = Pipeline.load(sys.argv[2], method="draft", threads=3, prefill="onnxruntime")       # target + draft model
text = a.generate("the quick brown fox", max_new_tokens=8).text + b.generate("the quick", max_new_tokens=8).text
print(json.dumps({"new_threads": threads() - before, "owner": PROCESS_POOL.owner, "pooled": pooled(a) + pooled(b)}))
""",
        heads_bundle,
        tiny_bundle,
    )
    assert out["owner"] == "specdec-edge" and out["pooled"] == [True] * 5
    assert out["new_threads"] == 2  # one pool of 3 threads (the caller's + 2 workers) for all 5 sessions


def test_not_spinning_gives_each_session_a_sleeping_pool(tiny_bundle):
    out = run(
        """
before = threads()
b = Pipeline.load(sys.argv[1], method="draft", threads=3, spinning=False, prefill="onnxruntime")
b.generate("the quick", max_new_tokens=4)
opts = [s.get_session_options() for s in (b.engines.target.session, b.engines.draft.session)]
print(json.dumps({"new_threads": threads() - before, "owner": PROCESS_POOL.owner,
                  "spin": [o.get_session_config_entry("session.intra_op.allow_spinning") for o in opts]}))
""",
        tiny_bundle,
    )
    assert out["owner"] is None and out["spin"] == ["0", "0"]
    assert out["new_threads"] == 4  # 2 workers per session: why sharing one pool matters


def test_an_application_pool_is_shared(tiny_bundle):
    out = run(
        """
ort.set_global_thread_pool_sizes(1, 1)  # the app made the pool before any pipeline
b = Pipeline.load(sys.argv[1], method="draft", threads=2)
ids = b.generate("the quick brown fox", max_new_tokens=12).token_ids
print(json.dumps({"owner": PROCESS_POOL.owner, "pooled": pooled(b), "ids": ids}))
""",
        tiny_bundle,
    )
    want = Pipeline.load(tiny_bundle, method="plain", threads=1).generate("the quick brown fox", max_new_tokens=12)
    assert out["owner"] == "application" and out["pooled"] == [True, True] and out["ids"] == want.token_ids


def test_an_application_with_its_own_sessions_keeps_working(tiny_bundle):
    out = run(
        """
model = os.path.join(sys.argv[1], "draft", "model.onnx")
mine = ort.InferenceSession(model, providers=["CPUExecutionProvider"])  # the app's own session, first
b = Pipeline.load(sys.argv[1], method="draft", threads=2)
b.generate("the quick", max_new_tokens=4)
later = ort.InferenceSession(model, providers=["CPUExecutionProvider"])  # and one made afterwards
opts = b.engines.target.session.get_session_options()
print(json.dumps({"owner": PROCESS_POOL.owner, "pooled": pooled(b),
                  "stop": opts.get_session_config_entry("session.force_spinning_stop")}))
""",
        tiny_bundle,
    )
    assert out["owner"] == "declined" and out["pooled"] == [False, False] and out["stop"] == "1"


def test_two_pipelines_from_several_threads_give_single_thread_output(tiny_bundle, heads_bundle):
    pipes = {
        "heads": Pipeline.load(heads_bundle, method="pld-eagle", threads=2),
        "draft": Pipeline.load(tiny_bundle, method="draft", threads=2),
    }
    prompts = ["the quick brown fox", "def add(a, b):", "speculative decoding verifies", "héllo wörld"]
    want = {(name, p): pipe.generate(p, max_new_tokens=16).token_ids for name, pipe in pipes.items() for p in prompts}
    got, errors = {}, []

    def work(name, prompt):
        try:
            got[name, prompt] = pipes[name].generate(prompt, max_new_tokens=16).token_ids
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    workers = [threading.Thread(target=work, args=key) for key in want for _ in range(2)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    assert not errors and got == want
