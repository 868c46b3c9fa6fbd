"""scripts/install.sh picks its Python as the README's set-up commands do (scripts/_python.sh).

A system-style Python that refuses pip installs (PEP 668) must lead to the project's own .venv,
made once and reused, without anything being installed into that system Python; an active
virtualenv or conda env is used as it is; a Python without its venv module names the package to
install. The package installs themselves are skipped (SPECDEC_INSTALL_SKIP_PIP): the script prints
the pip commands it would run, and a tiny local wheel stands in for the real install.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VER = "{}.{}".format(*sys.version_info[:2])


def make_system_python(root: Path, *, managed: bool = True, ensurepip: bool = True) -> Path:
    """A stand-in for a distribution's python3: this interpreter's binary copied into a prefix of its
    own (not a venv), whose stdlib dir links to the real stdlib's files and whose site-packages holds
    only pip. With `managed`, the EXTERNALLY-MANAGED marker in that stdlib dir makes pip refuse to
    install into it, as on Debian/Ubuntu; without `ensurepip`, it is Debian's python3 without
    python3-venv."""
    base_exe = Path(sys._base_executable).resolve()
    stdlib = Path(sysconfig.get_path("stdlib"))  # in a venv too: the base interpreter's
    (root / "bin").mkdir(parents=True)
    exe = root / "bin" / f"python{VER}"
    shutil.copy2(base_exe, exe)
    for name in ("python3", "python"):
        (root / "bin" / name).symlink_to(exe.name)
    libdir = sysconfig.get_config_var("LIBDIR")  # a shared libpython, if this build has one
    (root / "lib").mkdir(exist_ok=True)
    for so in Path(libdir).glob("libpython*.so*") if libdir else ():
        (root / "lib" / so.name).symlink_to(so)
    lib = root / "lib" / stdlib.name
    lib.mkdir()
    skip = {"site-packages", "dist-packages", "EXTERNALLY-MANAGED", "__pycache__"} | (
        set() if ensurepip else {"ensurepip"}
    )
    for entry in stdlib.iterdir():
        if entry.name not in skip:
            (lib / entry.name).symlink_to(entry)
    import pip  # into its own first site dir (Debian's site.py looks in lib/python3/dist-packages)

    site_dir = Path(py(exe, "import site; print(site.getsitepackages()[0])"))
    assert site_dir.is_relative_to(root), site_dir
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "pip").symlink_to(Path(pip.__file__).parent)
    if managed:
        (lib / "EXTERNALLY-MANAGED").write_text(
            "[externally-managed]\nError=test stand-in for a distribution's Python\n"
        )
    return root / "bin" / "python3"


def make_wheel(folder: Path) -> Path:
    """A one-module wheel (sde_probe), to show which Python a pip install can or cannot go into."""
    name, files = "sde_probe-1.0", {"sde_probe.py": b"OK = True\n"}
    files[f"{name}.dist-info/METADATA"] = b"Metadata-Version: 2.1\nName: sde-probe\nVersion: 1.0\n"
    files[f"{name}.dist-info/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = (
        "".join(
            f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
            for path, data in files.items()
        )
        + f"{name}.dist-info/RECORD,,\n"
    )
    files[f"{name}.dist-info/RECORD"] = record.encode()
    whl = folder / f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return whl


def py(python, code: str) -> str:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def site_dirs_state(python) -> dict:
    """What each site-packages dir of `python` holds, with mtimes: any install would change it."""
    dirs = py(python, "import site; print('\\n'.join(site.getsitepackages()))").splitlines()
    return {d: sorted((e.name, e.stat().st_mtime_ns) for e in os.scandir(d)) for d in dirs if os.path.isdir(d)}


def pip_install(python, wheel) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir", str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def repo(tmp_path):
    """A copy of the install scripts in a folder of their own: the .venv they make goes there."""
    (tmp_path / "repo" / "scripts").mkdir(parents=True)
    for name in ("install.sh", "_python.sh"):
        shutil.copy2(ROOT / "scripts" / name, tmp_path / "repo" / "scripts" / name)
    return tmp_path / "repo"


def run_install(repo: Path, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(
        ["bash", str(repo / "scripts" / "install.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**base, "SPECDEC_INSTALL_SKIP_PIP": "1", **env},
    )


def system_pythons() -> list:
    """The stand-in everywhere; the real /usr/bin/python3 too where it is externally managed (Debian, Ubuntu)."""
    real = Path("/usr/bin/python3")
    managed = (
        real.exists()
        and subprocess.run(
            [
                str(real),
                "-c",
                "import ensurepip, os, sysconfig, sys;"
                "sys.exit(not os.path.isfile(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')))",
            ],
            capture_output=True,
        ).returncode
        == 0
    )
    return [
        pytest.param("stand-in", id="stand-in"),
        pytest.param(
            str(real),
            id="usr-bin-python3",
            marks=pytest.mark.skipif(not managed, reason="no externally managed /usr/bin/python3 with venv here"),
        ),
    ]


@pytest.mark.parametrize("system", system_pythons())
def test_externally_managed_python_leads_to_the_project_venv(system, repo, tmp_path):
    python = make_system_python(tmp_path / "sys") if system == "stand-in" else Path(system)
    wheel = make_wheel(tmp_path)
    before = site_dirs_state(python)
    refused = pip_install(python, wheel)  # the dead end of the issue: pip refuses this Python
    assert refused.returncode != 0 and "externally-managed-environment" in refused.stderr, refused.stderr

    res = run_install(repo, PYTHON=str(python))
    assert res.returncode == 0, res.stdout + res.stderr
    venv_py = repo / ".venv" / "bin" / "python"
    said = [line for line in res.stdout.splitlines() if not line.startswith("skipped:")]
    assert len(said) == 1 and ".venv" in said[0] and "made it" in said[0], res.stdout
    # both pip commands go into the new venv's Python
    assert res.stdout.count(f"skipped: {venv_py} -m pip install") == 2, res.stdout
    prefix, base = py(
        venv_py, "import os, sys; print(sys.prefix); print(os.path.realpath(sys.base_prefix))"
    ).splitlines()
    assert Path(prefix) == repo / ".venv"
    assert base == py(python, "import os, sys; print(os.path.realpath(sys.prefix))")
    # and pip does install there
    assert pip_install(venv_py, wheel).returncode == 0

    again = run_install(repo, PYTHON=str(python))  # reused, not made anew: the probe is still in it
    assert again.returncode == 0 and "reusing it" in again.stdout, again.stdout + again.stderr
    assert py(venv_py, "import sde_probe; print(sde_probe.__file__)").startswith(str(repo / ".venv"))

    assert site_dirs_state(python) == before  # the system Python was not touched
    assert subprocess.run([str(python), "-c", "import sde_probe"], capture_output=True).returncode != 0

    if system == "stand-in":  # not externally managed (pyenv's, python.org's): still the project's .venv
        (Path(py(python, "import sysconfig; print(sysconfig.get_path('stdlib'))")) / "EXTERNALLY-MANAGED").unlink()
        plain = run_install(repo, PYTHON=str(python))
        assert plain.returncode == 0 and plain.stdout.count(f"skipped: {venv_py} -m pip install") == 2, plain.stdout


def test_python_without_venv_module_names_the_package(repo, tmp_path):
    python = make_system_python(tmp_path / "sys", ensurepip=False)  # Debian's python3 without python3-venv
    res = run_install(repo, PYTHON=str(python))
    assert res.returncode != 0
    assert f"apt install python{VER}-venv" in res.stderr, res.stderr
    assert "skipped:" not in res.stdout and not (repo / ".venv").exists()


@pytest.mark.parametrize("kind", ["virtualenv", "conda"])
def test_active_environment_is_used_as_it_is(kind, repo, tmp_path):
    if kind == "virtualenv":
        env_dir = tmp_path / "myenv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
        var = {"VIRTUAL_ENV": str(env_dir)}
    else:  # a conda env is a plain (not externally managed) prefix named by CONDA_PREFIX
        env_dir = tmp_path / "conda"
        make_system_python(env_dir, managed=False)
        var = {"CONDA_PREFIX": str(env_dir)}
    res = run_install(repo, PATH=f"{env_dir}/bin:{os.environ['PATH']}", **var)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[0].startswith(
        f"Python: the active {'virtualenv' if kind == 'virtualenv' else 'conda env'}"
    )
    assert res.stdout.count(f"skipped: {env_dir}/bin/python") == 2, res.stdout
    assert not (repo / ".venv").exists()
