#!/usr/bin/env bash
# Install everything from this repo's own files (into an active virtualenv, else the project's
# .venv; see scripts/_python.sh) and run the test suite with that Python.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/_python.sh
PYTHON=$PY bash scripts/install.sh || exit 1
if ! command -v Xvfb >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  # The desktop sample's test runs a real Tk window on a virtual screen.
  (apt-get update -qq && apt-get install -y -qq xvfb) >/dev/null 2>&1 || echo "note: could not install xvfb; the window test will skip"
fi
# As if that environment were activated: scripts the tests start find its python and commands first.
PATH="${PY%/*}:$PATH" "$PY" -m pytest -q "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
