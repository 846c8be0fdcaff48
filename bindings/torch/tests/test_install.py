"""`pip install .` (pyproject.toml, scikit-build-core) into a fresh virtual environment puts
rpe_torch and librpe_torch_ops.so into its site-packages, and the installed package imports and
computes from outside the repository, without RPE_TORCH_OPS.

Slow (configures the project and compiles the operator library, a few minutes): runs only with
RPE_TEST_PIP_INSTALL=1. The new venv sees the running interpreter's packages (torch,
scikit-build-core) through a .pth file, and pip builds without isolation against that torch."""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.skipif(os.environ.get("RPE_TEST_PIP_INSTALL") != "1",
                                reason="slow: set RPE_TEST_PIP_INSTALL=1 to build and install the wheel")


def test_pip_install_puts_the_package_and_its_library_in_site_packages(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, pip, scikit-build-core
    env = {k: v for k, v in os.environ.items() if k not in ("RPE_TORCH_OPS", "PYTHONPATH")}
    subprocess.run([str(py), "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-cache-dir",
                    str(ROOT)], check=True, env=env, cwd=tmp_path)
    assert (site / "rpe_torch" / "__init__.py").is_file()
    assert (site / "rpe_torch" / "librpe_torch_ops.so").is_file()
    code = ("import torch, rpe_torch; print(rpe_torch.library_path); q = torch.randn(1, 2, 5, 4); "
            "cfg = rpe_torch.get_rpe_config(skip=1, rpe_on='qkv'); "
            "print(rpe_torch.attention(q, q, q, *rpe_torch.build_rpe(cfg, 4, 2), height=2, width=2).shape)")
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True, env=env, cwd=tmp_path)
    path, shape = out.stdout.strip().splitlines()
    assert path == str(site / "rpe_torch" / "librpe_torch_ops.so")
    assert shape == "torch.Size([1, 2, 5, 4])"
