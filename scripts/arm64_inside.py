"""Inside the arm64 root (scripts/arm64_check.sh), with the light runtime only: load a bundle, run greedy plain and
every method the bundle offers on the same prompts, and compare each with plain on this device token for token.
Every call is a fresh one (reuse=False): a reused KV prefix need not equal a fresh prefill bit for bit on this
device (the verdict's ``reuse_matches_prefill``), and the comparison is of the calls users make first.

    python arm64_inside.py BUNDLE NAME HOST_JSON RESULT_JSON [MAX_NEW_TOKENS]
    python arm64_inside.py --verdicts NAME INFO_JSON      # after a load: this device's verdict beside the export's

Prints one line per check (PASS / FAIL / SKIP / INFO) and writes RESULT_JSON; exits 1 on any FAIL.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from arm64_prompts import MAX_NEW_TOKENS, PROMPTS  # noqa: E402

THREADS = int(os.environ.get("SPECDEC_ARM64_THREADS", "2"))  # arm64_check.sh --threads


def cpu_features() -> str:
    """The ARM features ONNX Runtime's kernels choose by (the kernel's hwcaps; under qemu, of the emulated CPU)."""
    try:
        import ctypes

        getauxval = ctypes.CDLL(None).getauxval
        getauxval.restype = ctypes.c_ulong
        hwcap, hwcap2 = getauxval(16), getauxval(26)  # AT_HWCAP, AT_HWCAP2
    except (OSError, AttributeError):
        return "?"
    bits = [(hwcap, 1, "asimd"), (hwcap, 10, "asimdhp"), (hwcap, 20, "asimddp"), (hwcap, 22, "sve")]
    bits += [(hwcap2, 1, "sve2"), (hwcap2, 13, "i8mm"), (hwcap2, 14, "bf16")]
    return " ".join(name for word, bit, name in bits if word >> bit & 1) or "none of asimd, dotprod, sve, i8mm"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (or where one ends), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def verdicts(name: str, info_json: Path) -> int:
    """The exactness verdicts `specdec-edge info --json` lists: the export machine's and this device's (measured
    on the first load here, since the device identity differs), one line each; FAIL when this device has none."""
    from specdec_edge.exactness import Verdict, describe

    info = json.loads(info_json.read_text())
    dtype = info["target"]["dtype"]
    here = [v for v in info.get("verdicts", []) if v["device"].get("arch") == platform.machine()]
    for v in info.get("verdicts", []):
        device = v["device"]
        where = f"{device.get('name', '?')} [{device.get('arch', '?')}; {' '.join(device.get('isa') or []) or '-'}]"
        print(f"INFO {name} verdict {v['measured']} on {where}: {describe(Verdict.from_json(v), dtype)}", flush=True)
    if not here:
        print(f"FAIL {name} verdict: none measured on this {platform.machine()} device", flush=True)
        return 1
    print(f"PASS {name} verdict measured on this device ({platform.machine()})", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[0] == "--verdicts":
        return verdicts(argv[1], Path(argv[2]))
    bundle, name, host_json, result_json = Path(argv[0]), argv[1], Path(argv[2]), Path(argv[3])
    max_new = int(argv[4]) if len(argv) > 4 else MAX_NEW_TOKENS
    failures = 0
    result = {"bundle": name, "machine": platform.machine(), "max_new_tokens": max_new, "methods": {}}

    def line(status: str, text: str) -> None:
        nonlocal failures
        failures += status == "FAIL"
        print(f"{status} {name} {text}", flush=True)

    t0 = time.perf_counter()
    import onnxruntime

    from specdec_edge import Pipeline
    from specdec_edge.bundle.hashes import check_hashes
    from specdec_edge.bundle.manifest import read_manifest
    from specdec_edge.errors import SpecdecError
    from specdec_edge.runtime.device import device_name
    from specdec_edge.speculative.methods import available_methods

    heavy = [m for m in ("torch", "transformers", "onnx") if m in sys.modules or importlib.util.find_spec(m)]
    line("FAIL" if heavy else "PASS", f"light runtime only: {', '.join(heavy) or 'no torch, transformers or onnx'}"
         f" (onnxruntime {onnxruntime.__version__}, {platform.machine()} with {cpu_features()}, "
         f"device {device_name('cpu')!r})")  # fmt: skip
    result["device"] = device_name("cpu")
    result["cpu_features"] = cpu_features()
    result["onnxruntime"] = onnxruntime.__version__

    manifest = read_manifest(bundle)
    check_hashes(bundle, manifest)
    methods = available_methods(manifest.draft is not None, manifest.heads)
    line("PASS", f"manifest and file sizes/hashes checked; methods offered: {', '.join(methods)}")
    prompts = PROMPTS[name]
    host = json.loads(host_json.read_text()) if host_json.is_file() else None

    t_load = time.perf_counter()
    pipe = Pipeline.load(bundle, method="plain", threads=THREADS)
    result["load_s"] = time.perf_counter() - t_load
    plain = []
    t_plain = time.perf_counter()
    for i, prompt in enumerate(prompts):
        plain.append(pipe.generate(prompt, max_new_tokens=max_new, reuse=False).token_ids)
        if host and i < len(host["plain"]):
            diff = first_difference(plain[-1], host["plain"][i][:max_new])
            same = "identical to" if diff is None else f"differs at token {diff} from"
            line("INFO", f"prompt {i}: plain on aarch64 ({len(plain[-1])} tokens) {same} plain on {host['machine']}")
            result.setdefault("plain_vs_host", []).append(diff)
    result["methods"]["plain"] = {"status": "PASS", "seconds": time.perf_counter() - t_plain}

    for method in methods:
        if method == "plain":
            continue
        t_m = time.perf_counter()
        try:
            other = pipe.with_method(method)
        except SpecdecError as e:  # the bundle's verdict does not allow it (e.g. trees on a quantized graph)
            line("SKIP", f"{method}: refused on load, as on the export machine: {e}")
            result["methods"][method] = {"status": "SKIP", "reason": str(e)}
            continue
        diffs, steps, new = [], 0, 0
        try:
            for i, prompt in enumerate(prompts):
                out = other.generate(prompt, max_new_tokens=max_new, reuse=False)
                diffs.append(first_difference(out.token_ids, plain[i]))
                steps += out.stats.steps
                new += len(out.token_ids)
        except Exception as e:  # noqa: BLE001 -- any error is this check's failure, reported and counted
            line("FAIL", f"{method}: {type(e).__name__}: {e}")
            result["methods"][method] = {"status": "FAIL", "error": f"{type(e).__name__}: {e}"}
            continue
        bad = [(i, d) for i, d in enumerate(diffs) if d is not None]
        status = "FAIL" if bad else "PASS"
        what = "identical to plain"
        if bad:
            what = "DIFFERS from plain: " + ", ".join(f"prompt {i} at token {d}" for i, d in bad)
        line(status, f"{method}: {len(prompts)} prompts, {new} tokens in {steps} target passes, {what}")
        result["methods"][method] = {
            "status": status,
            "tokens": new,
            "target_passes": steps,
            "first_differences": diffs,
            "seconds": time.perf_counter() - t_m,
        }
    pipe.close()
    result["seconds"] = time.perf_counter() - t0
    result["failures"] = failures
    result_json.write_text(json.dumps(result, indent=1))
    print(f"TIME {name} methods: {result['seconds']:.0f} s (emulated: says nothing about a real arm64 CPU)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
