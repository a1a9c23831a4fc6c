"""The real installer against a throwaway virtual environment and a local wheelhouse (no network):
install, prove the import in a child, and roll back a broken upgrade to what was there before."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hybridtune.kernels.install import PipInstaller
from hybridtune.kernels.provision import provision_kernel
from hybridtune.mixers.registry import KernelPackage

NAME = "hbt_fake_kernel"


def _wheel(folder, version: str, init: str):
    """A minimal pure-Python wheel built by hand (a zip with dist-info and a hashed RECORD)."""
    dist = f"{NAME}-{version}.dist-info"
    files = {
        f"{NAME}/__init__.py": init,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: hbt-fake-kernel\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: hybridtune-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(folder / f"{NAME}-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    root = tmp_path_factory.mktemp("pip")
    wheels = root / "wheels"
    wheels.mkdir()
    _wheel(wheels, "1.0", "VERSION = '1.0'\n")
    _wheel(wheels, "2.0", "raise ImportError('kernel library libfake.so not found')\n")  # installs, never imports
    venv = root / "venv"
    # --without-pip is instant; this interpreter's own pip is lent through a .pth that exposes pip alone.
    proc = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot create a virtual environment here: {proc.stderr[-300:]}")
    # pip's folder, asked of a child: pip imported (even looked up) in this process turns setuptools' distutils shim
    # off for the rest of it (_distutils_hack's spec_for_pip), and the process's first `import setuptools` after
    # that fails its check (inductor's CPU build imports it through torch.utils.cpp_extension: the slow tier's CPU
    # inductor tests failed on the xdist worker that had run this one).
    where = subprocess.run(
        [sys.executable, "-c", "import os, pip; print(os.path.dirname(pip.__file__))"], capture_output=True, text=True
    )
    if where.returncode != 0:
        pytest.skip(f"no pip in this environment: {where.stderr[-300:]}")
    shim = root / "pipshim"
    shim.mkdir()
    (shim / "pip").symlink_to(where.stdout.strip())
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    Path(purelib, "_pip_shim.pth").write_text(f"{shim}\n")
    return PipInstaller(python=str(python), env={}, wheelhouse=str(wheels))


@pytest.mark.slow  # three pip runs in a fresh virtual environment
def test_install_check_and_roll_back(sandbox):
    res = sandbox.install(["hbt-fake-kernel==1.0"])
    assert res.ok, res.output
    assert res.changed == {"hbt-fake-kernel": (None, "1.0")}
    assert sandbox.check_import(f"import {NAME}; assert {NAME}.VERSION == '1.0'")[0]

    spec = KernelPackage(
        name=NAME,
        distributions=("hbt-fake-kernel==2.0",),
        check_code=f"import {NAME}",
        accelerates="test",
        fallback_cost="test",
        fix="pip install hbt-fake-kernel==2.0",
    )
    state, version, detail = provision_kernel(spec, "auto", sandbox)
    assert state == "install-failed", detail
    assert "libfake.so" in detail and "rolled back" in detail
    assert sandbox.distributions()["hbt-fake-kernel"] == "1.0"  # the working version is back
    assert sandbox.check_import(f"import {NAME}")[0]
