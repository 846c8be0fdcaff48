"""Shared helpers of the rpe_torch tests: the repository paths, a tolerance check, iRPE modules
with random tables and a recorder of the operators rpe_torch.attention calls."""
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


def attention_operators(monkeypatch, call):
    """The attention forward operators (rpe::attention_forward or attention_forward_attn) that
    `call()` reaches through rpe_torch's operator namespace, in order (rpe_torch._ops replaced by
    a recorder for the test's duration)."""
    import rpe_torch
    used = []

    class Recorder:
        def __getattr__(self, name):
            used.append(name)
            return getattr(torch.ops.rpe, name)

    monkeypatch.setattr(rpe_torch, "_ops", Recorder())
    call()
    return [n for n in used if n.startswith("attention_forward")]


def attention_backward_op_args(*a, attn=None):
    """rpe::attention_backward's arguments from the arguments one by one: those of
    rpe_torch._registrations.attention_op_args (the forward's, by name) with grad_out after scale
    and attn after rope_skip (a[18], a[23]; trailing ones may be left out, attn also given by
    name). Returns the forward's grouped arguments followed by grad_out and attn."""
    from rpe_torch._registrations import attention_op_args
    named = a[:18] + a[19:23] + a[24:]
    return (*attention_op_args(*named), a[18], a[23] if len(a) > 23 else attn)


def random_irpe_modules(head_dim, num_heads, rpe_on, mode, shared_head, seed, method=None, skip=1, std=1.0):
    """(rpe_q, rpe_k, rpe_v) of rpe_torch.build_rpe (ratio 1.9, Product unless `method`; None where
    rpe_on attaches no term) in float64, every parameter drawn N(0, std²) from a generator seeded `seed`."""
    import rpe_torch
    method = rpe_torch.METHOD.PRODUCT if method is None else method
    cfg = rpe_torch.get_rpe_config(ratio=1.9, method=method, mode=mode, shared_head=shared_head, skip=skip, rpe_on=rpe_on)
    ms = rpe_torch.build_rpe(cfg, head_dim=head_dim, num_heads=num_heads)
    g = torch.Generator().manual_seed(seed)
    for m in ms:
        if m is not None:
            m.double()
            for p in m.parameters():
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)
    return ms
