"""rpe_torch against the reference's own irpe.py, when a copy is at hand: set RPE_REFERENCE_IRPE to
the folder that holds irpe.py (microsoft/Cream iRPE/DeiT-with-iRPE). Skipped otherwise (the
repository ships no reference code; the golden tests cover the same numbers without it).

For every mapping, mode, target set, shared or per-head tables and skip 0 / 1: the reference's
state_dict loads into rpe_torch's modules with strict=True, and each module gives the reference's
output and gradients on square grids (height and width omitted) and on a rectangular grid."""
import importlib.util
import itertools
import os
import warnings
from pathlib import Path

import pytest
import torch

import rpe_torch

REF = os.environ.get("RPE_REFERENCE_IRPE")
pytestmark = pytest.mark.skipif(not REF, reason="RPE_REFERENCE_IRPE is not set (folder of the reference's irpe.py)")


@pytest.fixture(scope="module")
def irpe():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = importlib.util.spec_from_file_location("reference_irpe", Path(REF) / "irpe.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod


CONFIGS = [(m, mode, shared, skip) for m, mode, shared, skip in
           itertools.product(["euc", "quant", "cross", "product"], ["bias", "ctx"], [True, False], [0, 1])]


@pytest.mark.parametrize("method,mode,shared,skip", CONFIGS)
def test_modules_equal_the_reference(irpe, method, mode, shared, skip):
    rpe_on = "qk" if mode == "bias" else "qkv"
    H, D = 3, 4
    kw = dict(ratio=1.9, method=method, mode=mode, shared_head=shared, skip=skip, rpe_on=rpe_on)
    theirs = torch.nn.ModuleList([m for m in irpe.build_rpe(irpe.get_rpe_config(**kw), D, H) if m is not None]).double()
    ours = torch.nn.ModuleList([m for m in rpe_torch.build_rpe(rpe_torch.get_rpe_config(**kw), D, H)
                                if m is not None]).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    for hw in [(None, None), (3, 5)]:
        L = skip + (hw[0] * hw[1] if hw[0] else 16)
        for a, b in zip(theirs, ours):
            transposed = (a.rp_rows if hasattr(a, "rp_rows") else a).transposed
            shape = (2, H, L, D) if transposed else (2, H, L, L)
            x = torch.randn(*shape, generator=g, dtype=torch.float64)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya, yb = a(xa, *hw), b(xb, *hw)
            assert ya.shape == yb.shape
            assert torch.allclose(ya, yb, atol=1e-12), (method, mode, hw)
            grad = torch.randn(ya.shape, generator=g, dtype=torch.float64)
            (ya * grad).sum().backward()
            (yb * grad).sum().backward()
            if mode == "ctx":
                assert torch.allclose(xa.grad, xb.grad, atol=1e-12)
    for (na, pa), (nb, pb) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert na == nb
        assert torch.allclose(pa.grad, pb.grad, atol=1e-10), na
