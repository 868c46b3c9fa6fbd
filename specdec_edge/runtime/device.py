"""What runs the passes: the identity of this device, as far as it changes a pass's rounding or its cost.

Two uses, one identity (``device_identity``, hashed by ``device_key``): the step costs ``auto`` measures
(``api/step_costs.py``) and the exactness verdict (``runtime/verdicts.py``) are kept per device, so a bundle copied
to another machine (another CPU model or instruction set, a GPU, another ONNX Runtime) is measured again there
instead of trusting numbers from the machine that exported it.
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


def _cpuinfo(text: str | None = None) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (or of ``text``; {} where there is none)."""
    fields: dict[str, str] = {}
    if text is None:
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


def _is_arm(machine: str) -> bool:
    return machine.lower().startswith(("aarch64", "arm"))


# (CPU implementer, CPU part) of an ARM /proc/cpuinfo, which has no "model name": Jetsons' and common cores.
ARM_CORES = {
    ("0x41", "0xd03"): "Cortex-A53",
    ("0x41", "0xd05"): "Cortex-A55",
    ("0x41", "0xd07"): "Cortex-A57",  # Jetson Nano, TX1, TX2
    ("0x41", "0xd08"): "Cortex-A72",
    ("0x41", "0xd0b"): "Cortex-A76",
    ("0x41", "0xd0c"): "Neoverse-N1",
    ("0x41", "0xd40"): "Neoverse-V1",
    ("0x41", "0xd42"): "Cortex-A78AE",  # Jetson Orin
    ("0x41", "0xd4f"): "Neoverse-V2",  # Grace
    ("0x4e", "0x004"): "NVIDIA Carmel",  # Jetson Xavier
}


def describe_cpu(info: dict[str, str], machine: str, board: str = "") -> str:
    """The CPU's name from its /proc/cpuinfo fields ``info``, the architecture ``machine`` and ``board``
    (/proc/device-tree/model, e.g. a Jetson's).

    x86: the "model name". ARM: the core (from implementer and part) and the board, with the architecture.
    Under user-mode emulation (qemu-user) /proc/cpuinfo is the x86 host's: an ARM process that reads an x86
    cpuinfo says it is emulated, so it is never taken for its host.
    """
    model = info.get("model name")
    if not _is_arm(machine):
        return model or platform.processor() or machine or "unknown"
    if "vendor_id" in info or "flags" in info:  # x86 fields seen by an emulated ARM process
        return f"{machine} emulated on {model or info.get('vendor_id') or 'another CPU'}"
    implementer, part = info.get("cpu implementer", "").lower(), info.get("cpu part", "").lower()
    core = model or ARM_CORES.get((implementer, part))
    core = core or (f"CPU implementer {implementer} part {part or '?'}" if implementer else "unknown core")
    board = board.strip("\x00 \n")
    return f"{machine} {core}{f', {board}' if board else ''}"


def cpu_name() -> str:
    """The CPU's model name; on ARM (no "model name" line), its core and board (``describe_cpu``)."""
    try:
        board = Path("/proc/device-tree/model").read_text(errors="replace")
    except OSError:
        board = ""
    return describe_cpu(_cpuinfo(), platform.machine(), board)


# AT_HWCAP / AT_HWCAP2 bits of arm64 Linux: what MLAS's ARM kernels are chosen by (not /proc/cpuinfo, which
# under qemu-user is the host's).
ARM_HWCAPS = {"fphp": (16, 9), "asimd": (16, 1), "asimdhp": (16, 10), "asimddp": (16, 20), "sve": (16, 22),
              "sve2": (26, 1), "i8mm": (26, 13), "bf16": (26, 14), "sme": (26, 23)}  # fmt: skip


def _arm_hwcaps() -> set[str] | None:
    """This ARM process's features from the kernel's auxiliary vector (getauxval), or None where unreadable."""
    try:
        import ctypes

        getauxval = ctypes.CDLL(None).getauxval
        getauxval.restype = ctypes.c_ulong
        getauxval.argtypes = [ctypes.c_ulong]
        words = {16: getauxval(16), 26: getauxval(26)}
    except (OSError, AttributeError):
        return None
    return {name for name, (word, bit) in ARM_HWCAPS.items() if words[word] >> bit & 1}


def cpu_features() -> list[str]:
    """The kernel-relevant instruction set features of this CPU (x86 "flags"; ARM: the kernel's hwcaps, else
    cpuinfo's "features")."""
    info = _cpuinfo()
    flags = _arm_hwcaps() if _is_arm(platform.machine()) else None
    if flags is None:
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
    """This device: everything a pass's rounding or cost may depend on (CPU model and features, GPU, provider, ONNX
    Runtime, threads), with its name (``device_name``). The one identity both caches key on (``device_key``): the
    exactness verdicts (``runtime/verdicts.py``) and the step costs (``api/step_costs.py``).

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
