"""Shared helpers of the rpe_torch tests: the repository paths and a tolerance check."""
import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = ROOT / "tests" / "data" / "golden"
DIGITS = ROOT / "examples" / "data" / "digits"
sys.path.insert(0, str(ROOT / "bindings" / "torch"))

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


def assert_close(actual, expected, atol, rtol, what):
    """|actual - expected| <= atol + rtol·|expected| elementwise (the golden README's rule)."""
    a = actual.detach().cpu().double().numpy() if isinstance(actual, torch.Tensor) else np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape}, expected {e.shape}"
    err = np.abs(a - e) - (atol + rtol * np.abs(e))
    worst = float(np.max(np.abs(a - e))) if a.size else 0.0
    assert np.all(err <= 0), f"{what}: max |diff| = {worst:.3e} exceeds atol {atol:g} + rtol {rtol:g}·|expected|"
