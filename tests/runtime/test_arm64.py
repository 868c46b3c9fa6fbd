"""aarch64: the device identification of the cost cache, and scripts/arm64_check.sh where its arm64 root exists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec_edge.runtime.device import _cpuinfo, cpu_features, describe_cpu, device_name

REPO = Path(__file__).resolve().parents[2]
X86 = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2\n\n"
    "processor\t: 1\n"
)
ORIN = (
    "processor\t: 0\nBogoMIPS\t: 62.50\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"
    "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd42\nCPU revision\t: 1\n\n"
    "processor\t: 1\nCPU implementer\t: 0x41\nCPU part\t: 0xd42\n"
)


def cpu_name(cpuinfo: str, machine: str, board: str = "") -> str:
    return describe_cpu(_cpuinfo(cpuinfo), machine, board)


def test_x86_cpu_is_its_model_name():
    assert cpu_name(X86, "x86_64") == "AMD EPYC 7B13"


def test_arm64_cpu_is_its_core_board_and_architecture():
    """arm64's /proc/cpuinfo has no "model name": the core comes from implementer/part, the board from the
    device tree."""
    assert cpu_name(ORIN, "aarch64", "NVIDIA Jetson AGX Orin Developer Kit\x00") == (
        "aarch64 Cortex-A78AE, NVIDIA Jetson AGX Orin Developer Kit"
    )
    assert cpu_name(ORIN.replace("0xd42", "0xabc"), "aarch64") == "aarch64 CPU implementer 0x41 part 0xabc"
    assert cpu_name("", "aarch64") == "aarch64 unknown core"


def test_emulated_arm64_is_not_taken_for_its_x86_host():
    """Under qemu-user, /proc/cpuinfo is the x86 host's: the arm64 process's costs must not share the host's key."""
    name = cpu_name(X86, "aarch64")
    assert name == "aarch64 emulated on AMD EPYC 7B13"
    assert name != cpu_name(X86, "x86_64")


def test_device_name_on_this_machine():
    assert device_name("cpu")
    assert cpu_features()  # x86 flags, or on ARM the kernel's hwcaps (qemu-user's emulated CPU's under emulation)


def arm64_missing() -> str | None:
    """Why scripts/arm64_check.sh cannot run here, or None: it needs root, binfmt's qemu-aarch64 and its arm64 root."""
    folder = Path(os.environ.get("SPECDEC_ARM64_DIR", "/var/tmp/specdec-arm64"))
    if not (folder / "root" / ".specdec-rootfs-ok").is_file():
        return f"no arm64 root at {folder}/root (make it once: sudo scripts/arm64_check.sh --setup-only)"
    if os.geteuid() != 0:
        return "chroot into the arm64 root needs root"
    handler = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not handler.is_file() or not handler.read_text().startswith("enabled"):
        return "the qemu-aarch64 binfmt handler is not enabled (scripts/arm64_check.sh enables it)"
    return None


@pytest.mark.arm64
def test_arm64_check_tiny_bundle():
    """The tiny bundle (target + draft) on aarch64 under emulation: every method identical to plain there, and
    generate, chat, info, verify (the real model's part, --real, takes too long for the test run)."""
    if reason := arm64_missing():
        pytest.skip(f"needs arm64: {reason}")
    env = dict(os.environ, PYTHON=sys.executable)
    run = subprocess.run(
        ["bash", str(REPO / "scripts" / "arm64_check.sh"), "--no-real"],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    out = run.stdout
    assert "PASS tiny light runtime only" in out
    for method in ("draft", "pld", "lookahead", "auto"):
        assert f"PASS tiny {method}:" in out and "identical to plain" in out
    for check in ("verify", "info", "generate", "chat"):
        assert f"PASS tiny {check}" in out
