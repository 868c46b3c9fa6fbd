"""What runs the passes: the identity of this device, as far as it changes a pass's rounding or its cost.

Two uses: the step costs ``auto`` measures (``speculative/costs.py``) and the exactness verdict
(``runtime/verdicts.py``) are kept per device, so a bundle copied to another machine (another CPU model
or instruction set, a GPU, another ONNX Runtime) is measured again there instead of trusting numbers
from the machine that exported it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import subprocess
from pathlib import Path

# The CPU features that pick ONNX Runtime's kernels (MLAS dispatches on them); other flags do not matter.
ISA_FLAGS = (
    "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
    "asimd", "asimddp", "fphp", "asimdhp", "sve", "sve2", "i8mm", "bf16", "sme",
)  # fmt: skip


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    return fields


def cpu_name() -> str:
    """The CPU's model name; on ARM (no "model name" line), its implementer and part numbers."""
    info = _cpuinfo()
    if info.get("model name"):
        return info["model name"]
    if info.get("cpu implementer"):
        return f"{platform.machine()} CPU implementer {info['cpu implementer']} part {info.get('cpu part', '?')}"
    return platform.processor() or platform.machine() or "unknown"


def cpu_features() -> list[str]:
    """The kernel-relevant instruction set features of this CPU (x86 "flags", ARM "features")."""
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("features") or "").split())
    return [f for f in ISA_FLAGS if f in flags]


def gpu_name() -> str | None:
    """The first NVIDIA GPU's name (nvidia-smi), or None."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return lines[0].strip() if lines else None


def device_name(provider: str) -> str:
    """What runs the passes, in words: the GPU's name for GPU providers (where one is found), else the CPU's."""
    return (gpu_name() if provider != "cpu" else None) or cpu_name()


def device_identity(provider: str, threads: str) -> dict:
    """Everything a pass's rounding may depend on: CPU model and features, GPU, provider, ONNX Runtime, threads.

    ``threads``: the thread setting as a string ("2", "default", ...)."""
    import onnxruntime as ort

    return {
        "name": device_name(provider),
        "arch": platform.machine(),
        "cpu": cpu_name(),
        "isa": cpu_features(),
        "gpu": gpu_name() if provider != "cpu" else None,
        "provider": provider,
        "onnxruntime": ort.__version__,
        "threads": threads,
    }


def device_key(identity: dict) -> str:
    """A short stable hash of ``identity`` (file names, comparisons)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
