"""float16 on the CPU operators: the rpe::f16 kernels (computed in float, each output rounded to
IEEE binary16 once; docs/attention.md "f16 storage") through the attention and timm-table
operators. Small and quick; test_half.py has the checks shared with bfloat16 (terms, RoPE, the
attention backward, autograd from saved probabilities, opcheck), test_bf16.py the models and the
compiled graphs.

- Bits (the rpe::f16 contract, one path): the float16 attention forward (out and attn) is exactly
  the float32 operator's result on the same values rounded to float16, rounded once (with and
  without RoPE, masks, key lengths, packed sequences).
- Values: against the float64 operators on the same f16-rounded inputs (exact in float64) within
  the C++ tests' bounds (tests/unit/test_attention_f16.cpp), u = 2⁻¹¹: attention output
  u·|ref| + 2⁻²⁵ + 1e-5·(1 + |ref| + Σⱼ pᵢⱼ|vⱼ|), probabilities u·p + 2⁻²⁵ + 1e-6.
- A mixed-dtype call is a TypeError naming both arguments; the table operators without a float16
  kernel refuse it naming theirs; a result beyond float16's range is ±∞.
- torch.autocast("cpu", dtype=torch.float16) runs the float16 kernels (float32 and bf16 inputs
  cast to float16, RoPE's real positions left alone, float64 left alone; the CPB / SAM tables in
  float32, returned in float16); a float32 RoPE block under it against float64.
"""
import pytest
import torch

import rpe_torch
from rpe_torch._registrations import LOW_PRECISION_KERNELS, autocast_compute_dtype
from test_library import B, D, H, attention_args, rnd, term_cases
from test_bf16 import ATTENTION, KEEP, ROPE_CASES, _logits_and_grads, _max_rel, _rope_model, _worst_grad, cast
from test_half import assert_bits, rounded

ops = torch.ops.rpe
F16 = torch.float16
F64 = torch.float64
U = 2.0 ** -11  # binary16 unit roundoff
TINY = 2.0 ** -25  # half the subnormal step: the rounding error of an output below 2^-14


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------

def test_timm_tables_in_f16_are_exact_transposes():
    t = rnd(15, H, grad=False, seed=7).to(F16)
    out = rpe_torch.table_from_timm(t)
    assert out.dtype == F16 and torch.equal(out.view(torch.int16), t.t().contiguous().view(torch.int16))
    back = rpe_torch.table_to_timm(out)
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))


# ---------------------------------------------------------------------------------------------
# Fused attention
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_attention_forward_f16_is_the_float_forward_rounded_once(name):
    h, f32, f64 = rounded(ATTENTION[name], F16, KEEP["attention_forward"])
    out = ops.attention_forward(*h)
    assert out.dtype == F16 and out.shape == h[0].shape and out.is_contiguous()
    assert_bits(out, ops.attention_forward(*f32), F16, name)
    ref = ops.attention_forward(*f64)
    v = f64[2]
    if name == "packed_grids":  # no probabilities output with packed sequences: Σⱼ pᵢⱼ|vⱼ| ≤ max|v|
        pv = torch.full_like(ref, float(v.abs().max()))
    else:
        out_a, attn = ops.attention_forward_attn(*h)
        out_a32, attn32 = ops.attention_forward_attn(*f32)
        assert_bits(out_a, out_a32, F16, f"{name}: out with attn")
        assert_bits(attn, attn32, F16, f"{name}: attn")
        _, attn64 = ops.attention_forward_attn(*f64)
        assert float(((attn.double() - attn64).abs() - (U * attn64 + TINY + 1e-6)).max()) <= 0, name
        pv = attn64 @ v.abs()
    s = ref.abs() + pv
    err = (out.double() - ref).abs()
    ratio = float((err / (U * ref.abs() + TINY + 1e-5 * (1 + s))).max())
    assert ratio <= 1, (name, ratio)


def test_f16_overflow_is_infinite():
    """Inputs are finite float16 values; an output whose float value is beyond 65504 rounds to +∞:
    v = 60000 and a contextual value table of 8000 everywhere (every query's term, the skip token's
    included, adds 8000: 68000 in float32), as any float16 rounding would; with a table of 1000
    (61000) every output is finite, the float32 result rounded once."""
    a = list(attention_args())
    L = a[0].shape[2]
    a[0:3] = [torch.zeros(B, H, L, D), torch.zeros(B, H, L, D), torch.full((B, H, L, D), 60000.0)]
    a[6] = ";".join(["", "", "", "", "product", "contextual"] + a[6].split(";")[6:])
    a[7] = [0.0] * 8 + a[7][8:]  # q, k: no method, no term values
    a[9] = a[10] = None  # no masks
    for value, finite in ((8000.0, False), (1000.0, True)):
        a[3:6] = [[], [], [torch.full((1, 26, D), value)]]
        h, f32, _ = rounded(a, F16)
        out, ref = ops.attention_forward(*h), ops.attention_forward(*f32)
        assert bool(torch.isfinite(ref).all()) and float(ref.min()) == pytest.approx(60000 + value, rel=1e-6)
        if finite:
            assert_bits(out, ref, F16, "in range")
            assert bool(torch.isfinite(out).all())
        else:
            assert out.dtype == F16 and bool(torch.isposinf(out).all())


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------



def test_f16_errors_name_the_argument():
    a = cast(attention_args(rope="mixed"), F16, KEEP["attention_forward"])

    def with_(i, value):
        return tuple(value if j == i else x for j, x in enumerate(a))

    def err(name, dtype, ref, ref_dtype):
        return pytest.raises(TypeError, match=rf"\[rpe.torch\] {name} has dtype torch\.{dtype} but {ref} has "
                                              rf"torch\.{ref_dtype}; ")
    with err("k", "float32", "q", "float16"):
        ops.attention_forward(*with_(1, a[1].float()))
    with err("v", "bfloat16", "q", "float16"):
        ops.attention_forward(*with_(2, a[2].bfloat16()))
    with err("rope_freqs", "float32", "q", "float16"):
        ops.attention_forward(*with_(12, a[12].float()))
    t = cast(term_cases()["ctx_k_product_shared"], F16)
    with err("x", "float32", r"tables\[0\]", "float16"):
        ops.term_forward(t[0].float(), *t[1:])
    x = rnd(B, H, 7, D, grad=False).to(F16)
    with err("grad_y", "float32", "x", "float16"):
        ops.rope_backward(x, x.float(), "axial", [100.0], None, 1, 2, 3)
    with pytest.raises(TypeError, match=r"\[rpe.torch\] q has dtype torch\.int32; expected float32, float64, "
                                        r"bfloat16 or float16"):
        rpe_torch.attention(*(torch.zeros(B, H, 7, D, dtype=torch.int32),) * 3)
    # the table operators without a float16 kernel name theirs
    with pytest.raises(TypeError, match=r"\[rpe.torch\] raw has dtype torch\.float16; expected float32 or float64"):
        ops.cpb_table(torch.zeros(15, H, dtype=F16), 2, 3, True)


# ---------------------------------------------------------------------------------------------
# CPU autocast with float16
# ---------------------------------------------------------------------------------------------

def test_cpu_autocast_f16_runs_the_f16_kernels():
    """Under float16 autocast an operator gives exactly the float16 operator on its inputs cast to
    float16; RoPE's real positions are not rounded; operators without a float16 kernel compute in
    float32; float64 is left alone."""
    assert LOW_PRECISION_KERNELS[("cpu", F16)].keys() == LOW_PRECISION_KERNELS[("cpu", torch.bfloat16)].keys()
    for name in ("term_forward", "attention_forward", "attention_forward_attn", "rope_forward", "table_from_timm"):
        assert autocast_compute_dtype(name, "cpu", F16) == F16, name
    assert autocast_compute_dtype("cpb_table", "cpu", F16) == torch.float32
    a32 = cast(attention_args(rope="mixed"), torch.float32)
    with torch.autocast("cpu", dtype=F16):
        out = ops.attention_forward(*a32)
        out_a = ops.attention_forward_attn(*a32)
        out_b = ops.attention_forward(*cast(a32, torch.bfloat16))  # bf16 inputs cast to float16 too
    want = ops.attention_forward(*cast(a32, F16))
    assert out.dtype == F16 and torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert all(t.dtype == F16 for t in out_a)
    assert torch.equal(out_b.view(torch.int16), ops.attention_forward(*cast(cast(a32, torch.bfloat16), F16))
                       .view(torch.int16))
    r32 = cast(ROPE_CASES["rope_forward[axial_half_positions]"], torch.float32, KEEP["rope_forward"])
    with torch.autocast("cpu", dtype=F16):
        y = ops.rope_forward(*r32)
    want = ops.rope_forward(*cast(r32, F16, KEEP["rope_forward"]))  # positions as given
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    t32 = cast(term_cases()["ctx_v_euclidean"], torch.float32)
    with torch.autocast("cpu", dtype=F16):
        t = ops.term_forward(*t32)
    assert torch.equal(t.view(torch.int16), ops.term_forward(*cast(t32, F16)).view(torch.int16))
    raw = rnd(15, H, grad=False).float()
    with torch.autocast("cpu", dtype=F16):
        table = ops.cpb_table(raw, 2, 3, True)
    assert table.dtype == F16 and torch.equal(table, ops.cpb_table(raw, 2, 3, True).to(F16))
    with torch.autocast("cpu", dtype=F16):
        assert ops.attention_forward(*attention_args()).dtype == F64


def test_cpu_autocast_f16_rope_block():
    """A float32 RoPE-Mixed block with iRPE on k under torch.autocast("cpu", dtype=torch.float16):
    gradients reach the float32 parameters in float32; output and gradients against float64
    (measured 0.0001 and 0.0021 of the scale; bf16 autocast: 0.0008, 0.009)."""
    m64, x64 = _rope_model(F64)
    ref, ref_grads = _logits_and_grads(m64, x64)
    m32, x32 = _rope_model(torch.float32)
    out, grads = _logits_and_grads(m32, x32, torch.autocast("cpu", dtype=F16))
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert grads.keys() == ref_grads.keys()
    assert _max_rel(out, ref) <= 2e-3, _max_rel(out, ref)
    worst = _worst_grad(grads, ref_grads)
    assert worst <= 2e-2, worst
