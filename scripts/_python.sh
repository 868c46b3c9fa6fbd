# Sourced (from the repo root) by install.sh, test.sh and quickstart.sh: sets PY to the Python that
# everything is installed into and run with, and says which in one line.
#   Which Python: $PYTHON, else the active virtualenv's ($VIRTUAL_ENV) or conda env's ($CONDA_PREFIX),
#   else python3. A virtualenv's Python, or the active conda env's, is used as it is. Any other
#   Python (a distribution's, which pip refuses to install into since PEP 668; pyenv's; ...) only
#   makes, then reuses, the project's own .venv, and PY is that venv's python.
# The line is left out when $PYTHON names a Python that is used as it is (a parent script passes its
# choice on that way). On failure (no Python, or it cannot make a venv) it exits the sourcing script.

_cand=${PYTHON:-}
if [ -z "$_cand" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then _cand=$VIRTUAL_ENV/bin/python
  elif [ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]; then _cand=$CONDA_PREFIX/bin/python
  else _cand=$(command -v python3 || command -v python || echo python3)
  fi
fi
# kind (venv | conda | other), sys.executable, real sys.prefix, X.Y: one tab-separated line
_info=$("$_cand" -c '
import os, sys
conda = os.environ.get("CONDA_PREFIX")
real = os.path.realpath
kind = ("venv" if sys.prefix != sys.base_prefix else
        "conda" if conda and real(conda) == real(sys.prefix) else "other")
print(kind, sys.executable, real(sys.prefix), "%d.%d" % sys.version_info[:2], sep="\t")') || {
  echo "error: no working Python ($_cand); install Python 3.10+ or set PYTHON=/path/to/python" >&2; exit 1; }
IFS=$'\t' read -r _kind _exe _prefix _ver <<<"$_info"

if [ "$_kind" != other ]; then
  PY=$_exe
  [ -n "${PYTHON:-}" ] || echo "Python: the active $([ "$_kind" = venv ] && echo virtualenv || echo conda env) $_prefix (Python $_ver)"
else
  _venv=$PWD/.venv
  # Reuse .venv if it runs, has pip and was made from this same Python; otherwise make it anew.
  _from=$("$_venv/bin/python" -c 'import os, sys, pip; print(os.path.realpath(sys.base_prefix))' 2>/dev/null || true)
  if [ -n "$_from" ] && [ "$_from" = "$_prefix" ]; then
    _how=reusing
  else
    if [ -n "$_from" ]; then echo "note: .venv was made from the Python in $_from, not $_prefix: making it anew"
    elif [ -e "$_venv" ]; then echo "note: .venv does not run or has no pip: making it anew"
    fi
    if ! "$_exe" -c 'import venv, ensurepip' 2>/dev/null; then
      echo "error: $_exe cannot make a virtualenv: its venv module is missing (Debian/Ubuntu: apt install python$_ver-venv, or python3-venv)." >&2
      echo "Install it and run this again, or activate a virtualenv of your own first." >&2
      exit 1
    fi
    rm -rf "$_venv"
    "$_exe" -m venv "$_venv" || { rm -rf "$_venv"; echo "error: $_exe -m venv $_venv failed" >&2; exit 1; }
    _how=made
  fi
  PY=$_venv/bin/python
  echo "Python: $_exe is not in a virtualenv, so everything goes into the project's .venv ($_how it; Python $_ver)"
fi
unset _cand _info _kind _exe _prefix _ver _venv _from _how
