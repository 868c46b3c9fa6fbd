"""What a GGUF file's quantized weights carry over as (export/gguf_blocks.py), and how exactly.

Usage:
  python benchmarks/gguf_blocks.py FILE.gguf [--hf]

Prints the file's tensor types (counts, bytes), the type of each linear weight by role, how long
the conversion takes, the ``BlockQuantized`` forms it gives, their size as MatMulNBits inputs
(packed values, fp32 scales, zero points, fp32 minima) against the GGUF blocks and fp32, and with
``--hf`` the largest |dequantized - weight transformers loads from the same file| per tensor.
"""

from __future__ import annotations

import argparse
import collections
import re
import time
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from specdec_edge.export.gguf_blocks import gguf_linear_types, gguf_linear_weights, hf_name


def packed_bytes(w) -> int:
    data, scales, zero = w.packed()
    return data.nbytes + scales.nbytes + zero.nbytes + (0 if w.mins is None else w.mins.nbytes)


def report_file(path: Path) -> None:
    reader = GGUFReader(path)
    count, size = collections.Counter(), collections.Counter()
    for t in reader.tensors:
        count[t.tensor_type.name] += 1
        size[t.tensor_type.name] += t.n_bytes
    print(f"{path.name}: {reader.fields['general.architecture'].contents()}")
    for name in count:
        print(f"  {name}: {count[name]} tensors, {size[name] / 2**20:.2f} MiB")
    roles = collections.defaultdict(collections.Counter)
    for name, qtype in gguf_linear_types(path).items():
        roles[re.sub(r"layers\.\d+\.", "layers.*.", name)][qtype] += 1
    for role, types in roles.items():
        print(f"  {role}: {dict(types)}")


def report_weights(path: Path, weights: dict) -> None:
    forms = collections.Counter((w.bits, w.block, w.mins is not None) for w in weights.values())
    print("  forms (bits, block, has minima):", dict(forms))
    gguf_bytes = {hf_name(t.name): t.n_bytes for t in GGUFReader(path).tensors}
    parts = [("all converted", list(weights)), ("without the embedding", [k for k in weights if "embed" not in k])]
    for label, keys in parts:
        packed = sum(packed_bytes(weights[k]) for k in keys)
        fp32 = sum(weights[k].q.size * 4 for k in keys)
        blocks = sum(gguf_bytes[k] for k in keys)
        print(
            f"  {label}: {packed / 2**20:.2f} MiB as MatMulNBits inputs, {blocks / 2**20:.2f} MiB GGUF blocks, "
            f"{fp32 / 2**20:.2f} MiB fp32 ({fp32 / packed:.2f}x)"
        )


def compare_with_transformers(path: Path, weights: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    state = model.state_dict()
    diffs = {k: float(np.abs(w.dequantize() - state[k].numpy()).max()) for k, w in weights.items()}
    worst = max(diffs, key=diffs.get)
    nonzero = sum(d > 0 for d in diffs.values())
    print(f"  vs transformers: max |diff| {diffs[worst]:.3g} ({worst}); {nonzero} of {len(diffs)} tensors differ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--hf", action="store_true", help="also compare with the weights transformers loads")
    args = ap.parse_args()
    report_file(args.gguf)
    start = time.perf_counter()
    weights = gguf_linear_weights(args.gguf)
    print(f"  converted {len(weights)} tensors in {time.perf_counter() - start:.1f} s")
    report_weights(args.gguf, weights)
    if args.hf:
        compare_with_transformers(args.gguf, weights)


if __name__ == "__main__":
    main()
