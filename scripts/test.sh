#!/usr/bin/env bash
# Install everything from this repo's own files and run the test suite.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
if ! command -v Xvfb >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  # The desktop sample's test runs a real Tk window on a virtual screen.
  (apt-get update -qq && apt-get install -y -qq xvfb) >/dev/null 2>&1 || echo "note: could not install xvfb; the window test will skip"
fi
${PYTHON:-python3} -m pytest -q "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
