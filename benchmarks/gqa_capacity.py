"""Does GroupQueryAttention's cost follow the cache capacity or the valid length? One op, SmolLM2's shapes.

Usage:
  python benchmarks/gqa_capacity.py --capacities 512 2048 8192 --past 256 480 --widths 2 8

One ``com.microsoft.GroupQueryAttention`` (9 query / 3 KV heads, head dim 64, rotary inside) in share-buffer
mode, the cache bound as input and output as the runtime does, one thread; the capacities are interleaved and
timed by the process's CPU time (steady on a loaded machine). Prints microseconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def session(capacity: int):
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    inputs = [
        helper.make_tensor_value_info("q", T.FLOAT, [1, "S", width]),
        helper.make_tensor_value_info("pk", T.FLOAT, [1, KV_HEADS, capacity, HEAD_DIM]),
        helper.make_tensor_value_info("pv", T.FLOAT, [1, KV_HEADS, capacity, HEAD_DIM]),
        helper.make_tensor_value_info("sk", T.INT32, [1]),
        helper.make_tensor_value_info("tot", T.INT32, []),
        helper.make_tensor_value_info("pos", T.INT64, [1, "S"]),
        helper.make_tensor_value_info("bias", T.FLOAT, [1, 1, "S", "T"]),
    ]
    outputs = [helper.make_tensor_value_info(n, T.FLOAT, None) for n in ("o", "k", "v")]
    angles = np.arange(capacity)[:, None] / (10000 ** (np.arange(HEAD_DIM // 2) / (HEAD_DIM // 2)))
    inits = [
        nh.from_array(np.cos(angles).astype(np.float32), "cos"),
        nh.from_array(np.sin(angles).astype(np.float32), "sin"),
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "", "", "pk", "pv", "sk", "tot", "cos", "sin", "pos", "bias"],
        ["o", "k", "v"],
        domain="com.microsoft",
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        do_rotary=1,
    )
    model = helper.make_model(
        helper.make_graph([node], "gqa", inputs, outputs, inits),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
    )
    model.ir_version = 10
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts)
    cache = np.random.default_rng(0).standard_normal((2, 1, KV_HEADS, capacity, HEAD_DIM)).astype(np.float32)
    values = [ort.OrtValue.ortvalue_from_numpy(cache[i]) for i in range(2)]
    binding = sess.io_binding()
    for i, (inp, out) in enumerate((("pk", "k"), ("pv", "v"))):
        binding.bind_ortvalue_input(inp, values[i])
        binding.bind_ortvalue_output(out, values[i])
    return sess, binding, (cache, values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacities", nargs="+", type=int, default=[512, 2048, 8192])
    ap.add_argument("--past", nargs="+", type=int, default=[256, 480])
    ap.add_argument("--widths", nargs="+", type=int, default=[2, 8])
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    sessions = {c: session(c) for c in args.capacities}
    rng = np.random.default_rng(1)
    print("| past | S | " + " | ".join(f"capacity {c} us" for c in args.capacities) + " |")
    print("|---|---|" + "---:|" * len(args.capacities))
    for past in args.past:
        for s in args.widths:
            q = rng.standard_normal((1, s, (HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
            bias = np.zeros((1, 1, s, past + s), np.float32)
            for i in range(s):
                bias[0, 0, i, past + i + 1 :] = -np.inf
            for _sess, binding, _ in sessions.values():
                binding.bind_cpu_input("q", q)
                binding.bind_cpu_input("sk", np.array([past + s - 1], np.int32))
                binding.bind_cpu_input("tot", np.array(past + s, np.int32))
                binding.bind_cpu_input("pos", (past + np.arange(s))[None].astype(np.int64))
                binding.bind_cpu_input("bias", bias)
                binding.bind_output("o")
            times = {c: [] for c in args.capacities}
            for _ in range(args.repeats):
                for c, (sess, binding, _) in sessions.items():
                    t0 = time.process_time()
                    sess.run_with_iobinding(binding)
                    times[c].append(time.process_time() - t0)
            print(
                f"| {past} | {s} | "
                + " | ".join(f"{1e6 * statistics.mean(times[c]):.0f}" for c in args.capacities)
                + " |"
            )


if __name__ == "__main__":
    main()
