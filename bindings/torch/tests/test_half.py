"""The checks that bfloat16 and float16 on the CPU operators share, each test parametrized over the
two dtypes (ids bf16, f16): the library computes in float and rounds each output to the dtype once
(docs/attention.md, "bf16 storage" and "f16 storage"), so

- Bits: every output and gradient of the 16-bit term, RoPE and attention-backward operators is
  exactly the float32 operator's result on the same values rounded to the dtype once (the backward
  also from saved 16-bit probabilities).
- Values: against the float64 operators on the same rounded inputs (exact in float64) within the
  C++ tests' bounds (tests/unit/test_term_half.cpp, test_attention_bf16.cpp, test_attention_f16.cpp):
  u·|ref| + tiny + 16·N·2⁻²⁴·max|G_ref| per tensor G (N the terms of each sum), u = 2⁻⁸ for bf16,
  2⁻¹¹ for f16; tiny = 2⁻²⁵ for f16 (half its subnormal step), 1e-30 for bf16.
- rpe_torch.attention in the dtype: the backward from the saved probabilities within 4u·max|G| of
  the one that recomputes them.
- Every CPU operator with a 16-bit kernel passes torch.library.opcheck in the dtype.

What differs between the dtypes stays in test_bf16.py (the AVX512_BF16 forward's bounds, models,
compiled graphs, mixed-dtype errors) and test_f16.py (the forward's bits, range, errors, autocast).
"""
import pytest
import torch

import rpe_torch
from test_library import B, D, H, op_cases, rnd, GRADCHECK_ONLY
from test_bf16 import ATTENTION, KEEP, ROPE_CASES, TERMS, _buckets, cast, flat

ops = torch.ops.rpe
F64 = torch.float64

#: Per dtype: the unit roundoff u of one rounding to it, and what the bounds add near 0.
U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
TINY = {torch.bfloat16: 1e-30, torch.float16: 2.0 ** -25}
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="f16")]

#: The operators with a bf16 and a float16 CPU kernel, each checked by opcheck in both.
HALF_OPS = ("term_forward", "term_backward", "attention_forward", "attention_forward_attn", "attention_backward",
            "rope_forward", "rope_backward", "table_from_timm", "table_to_timm")


def rounded(args, dtype, keep=()):
    """args with their floating tensors rounded to dtype (then as dtype, float32, float64)."""
    h = cast(args, dtype, keep)
    return h, cast(h, torch.float32, keep), cast(h, F64, keep)


def assert_bits(got, want32, dtype, what):
    """got (dtype) is exactly want32 (float32) rounded to dtype once (to nearest even, as torch's cast)."""
    assert got.dtype == dtype, what
    want = want32.to(dtype)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
        f"{what}: {int((got.view(torch.int16) != want.view(torch.int16)).sum())} of {got.numel()} values differ"


def ratio_to_bound(got, ref, n):
    """max |got − ref| / (u·|ref| + tiny + 16·n·2⁻²⁴·max|ref|) for got's dtype: the C++ tests' bound
    for one rounding after a float computation of sums of at most n terms."""
    if ref.numel() == 0:
        return 0.0
    ref = ref.double()
    err = (got.double() - ref).abs()
    bound = U[got.dtype] * ref.abs() + TINY[got.dtype] + 16 * n * 2.0 ** -24 * float(ref.abs().max())
    return float((err / bound).max())


# ---------------------------------------------------------------------------------------------
# Terms, RoPE
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TERMS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_term_is_the_float_term_rounded_once(dtype, name):
    args = TERMS[name]
    h, f32, f64 = rounded(args, dtype)
    out = ops.term_forward(*h)
    assert out.dtype == dtype and out.is_contiguous()
    assert_bits(out, ops.term_forward(*f32), dtype, f"{name}: forward")
    L = out.shape[-2]
    n = L + D + max(t.shape[-1] if t.dim() == 2 or name.startswith("ctx_k") else t.shape[1] for t in args[1])
    assert ratio_to_bound(out, ops.term_forward(*f64), n) <= 1, name
    g = rnd(*out.shape, grad=False, seed=21).to(dtype)
    grads = ops.term_backward(h[0], h[1], g, *h[2:])
    grads32 = ops.term_backward(f32[0], f32[1], g.float(), *f32[2:])
    grads64 = ops.term_backward(f64[0], f64[1], g.double(), *f64[2:])
    for i, (gh, g32, g64) in enumerate(zip(grads, grads32, grads64)):
        assert gh.dtype == dtype and gh.shape == g64.shape
        assert_bits(gh, g32, dtype, f"{name}: gradient {i}")
        # a table's gradient sums over (batch, head, query, key): N·B·H·L terms at most
        assert ratio_to_bound(gh, g64, n * B * H * L if i else n) <= 1, (name, i)


@pytest.mark.parametrize("name", sorted(ROPE_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_is_the_float_rotation_rounded_once(dtype, name):
    h, f32, f64 = rounded(ROPE_CASES[name], dtype, KEEP["rope_forward"])
    y = ops.rope_forward(*h)
    assert_bits(y, ops.rope_forward(*f32), dtype, f"{name}: forward")
    assert ratio_to_bound(y, ops.rope_forward(*f64), 2) <= 1, name
    gy = rnd(*y.shape, grad=False, seed=5).to(dtype)
    gh = ops.rope_backward(h[0], gy, *h[1:])  # rope_backward: x, grad_y, then rope_forward's arguments
    g32 = ops.rope_backward(f32[0], gy.float(), *f32[1:])
    g64 = ops.rope_backward(f64[0], gy.double(), *f64[1:])
    for i in range(2):
        assert gh[i].dtype == dtype and gh[i].shape == g64[i].shape
        assert_bits(gh[i], g32[i], dtype, f"{name}: gradient {i}")
        # the frequency gradient sums over (batch, token) pairs
        assert ratio_to_bound(gh[i], g64[i], 2 if i == 0 else 2 * B * y.shape[2]) <= 1, (name, i)


# ---------------------------------------------------------------------------------------------
# Fused attention: the backward
# ---------------------------------------------------------------------------------------------

def _backward(args, grad_out, attn=None):
    """attention_backward: the forward's arguments, then grad_out and attn."""
    return ops.attention_backward(*args, grad_out, attn)


@pytest.mark.parametrize("name", sorted(ATTENTION))
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_backward_is_the_float_backward_rounded_once(dtype, name):
    a = ATTENTION[name]
    h, f32, f64 = rounded(a, dtype, KEEP["attention_forward"])
    g = rnd(*h[0].shape, grad=False, seed=71).to(dtype)
    got = _backward(h, g)
    want32 = _backward(f32, g.float())
    want64 = _backward(f64, g.double())
    assert len(got) == len(want64)
    L = h[0].shape[2]
    n = L + D + _buckets(a)
    for i, (gh, g32, g64) in enumerate(zip(got, want32, want64)):
        assert gh.dtype == dtype and gh.shape == g64.shape and gh.is_contiguous()
        assert_bits(gh, g32, dtype, f"{name}: gradient {i}")
        assert ratio_to_bound(gh, g64, n if i < 3 else n * B * H * L) <= 1, (name, i)
    if name != "packed_grids":  # from the saved probabilities: the float backward on them, rounded once
        attn = ops.attention_forward_attn(*h)[1]
        for i, (gh, g32) in enumerate(zip(_backward(h, g, attn), _backward(f32, g.float(), attn.float()))):
            assert_bits(gh, g32, dtype, f"{name}: gradient {i} from saved attn")


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_autograd_with_saved_probabilities(dtype):
    """rpe_torch.attention on 16-bit tensors and modules: output and gradients in the dtype; the
    backward from the saved probabilities within 4u·max|G| of the one that recomputes them."""
    cfg = rpe_torch.get_rpe_config(ratio=1.0, method="product", mode="ctx", shared_head=False, skip=1, rpe_on="qkv")
    mods = [m.to(dtype) for m in rpe_torch.build_rpe(cfg, head_dim=D, num_heads=H)]
    with torch.no_grad():
        for m in mods:
            for p in m.parameters():
                p.normal_()
    q, k, v = (rnd(B, H, 7, D, seed=s).detach().to(dtype).requires_grad_() for s in (81, 82, 83))
    params = [p for m in mods for p in m.parameters()]
    grads = {}
    for save in (True, False):
        for t in (q, k, v, *params):
            t.grad = None
        out = rpe_torch.attention(q, k, v, *mods, height=2, width=3, save_attn=save)
        assert out.dtype == dtype
        (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        grads[save] = [t.grad.clone() for t in (q, k, v, *params)]
    for a, b in zip(grads[True], grads[False]):
        assert a.dtype == dtype
        assert float((a.double() - b.double()).abs().max()) <= 4 * U[dtype] * float(b.double().abs().max()) + 1e-6


# ---------------------------------------------------------------------------------------------
# Registration: opcheck in both dtypes
# ---------------------------------------------------------------------------------------------

CASES = {n: (op, a) for n, (op, a) in op_cases().items() if n.split("[")[0] in HALF_OPS and n not in GRADCHECK_ONLY}


def test_every_half_operator_is_opchecked():
    assert {n.split("[")[0] for n in CASES} == set(HALF_OPS)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype, name):
    op, a = CASES[name]
    args = cast(a, dtype, KEEP.get(name.split("[")[0], ()), grad=True)
    for t in flat(op(*args)):
        assert t.dtype == dtype and t.is_contiguous(), name
    torch.library.opcheck(op, args)  # fake kernels: the real ones' dtypes and strides; aot dispatch
