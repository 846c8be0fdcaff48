"""bfloat16 on the CPU operators: the rpe::bf16 kernels (computed in float, each output rounded to
bf16 once; docs/attention.md "bf16 storage") through the term, attention and RoPE operators.

- Values: against the float64 operators on the same bf16-rounded inputs (exact in float64, so
  both compute the same problem) within the C++ tests' bounds (tests/unit/test_attention_bf16.cpp):
  forward attention |got − ref| ≤ u·(|ref| + Σⱼ pᵢⱼ|vⱼ|) + 1e-5·(1 + |ref| + Σⱼ pᵢⱼ|vⱼ|), the
  probabilities within u·p + 1e-6, u = 2⁻⁸.
- Bits: the forward with RoPE, key lengths or packed sequences (the portable path) gives exactly
  the float32 operator's result on the same values rounded to bf16.
- The terms, RoPE, the attention backward, autograd from saved probabilities and opcheck in bf16:
  test_half.py (parametrized over bfloat16 and float16; this file holds the case tables it
  shares). A mixed-dtype call is a TypeError naming the argument (float16 on the CPU:
  tests/test_f16.py).
- Models: the digits DeiT-iRPE (K: bias Euclidean per head; QKV: contextual Product) converted
  with .to(torch.bfloat16), and float32 models under torch.autocast("cpu", dtype=torch.bfloat16),
  against float64 (logits and gradients; float32 parameters get float32 gradients);
  torch.compile(fullgraph=True) of both.
"""
import math

import pytest
import torch

import rpe_torch
from conftest import attention_operators
from digits_model import build, images
from test_library import (B, D, H, attention_args, index_attention_args, op_cases, rnd,
                          rope_positions_attention_args, term_cases)
from test_compile import RoPEBlock

ops = torch.ops.rpe
BF = torch.bfloat16
F64 = torch.float64
U = 2.0 ** -8  # bf16 unit roundoff

#: Floating arguments that are real-valued positions (read in float32 by the library): never cast
#: to bf16. Indices in each operator's schema (the attention operators': their list ``indices``,
#: which holds the RoPE's positions).
KEEP = {"rope_forward": (8,), "rope_backward": (9,), "attention_forward": (13,), "attention_forward_attn": (13,),
        "attention_backward": (13,)}


def cast(args, dtype, keep=(), grad=False):
    """args with every float64 / float32 / bf16 tensor (lists walked) as dtype, detached (the
    values of a bf16 tensor are exact in float32 and float64); indices in keep left as given."""
    def c(a):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.detach().to(dtype).requires_grad_(grad and a.requires_grad)
        if isinstance(a, list):
            return [c(x) for x in a]
        return a
    return tuple(a if i in keep else c(a) for i, a in enumerate(args))


def rounded(args, keep=()):
    """args with their floating tensors rounded to bf16 (then as bf16, float32, float64)."""
    b = cast(args, BF, keep)
    return b, cast(b, torch.float32, keep), cast(b, F64, keep)


def flat(x):
    return [t for a in (x if isinstance(x, (list, tuple)) else [x]) for t in (a if isinstance(a, list) else [a])]


def assert_bits(got, want32, what):
    """got (bf16) is exactly want32 (float32) rounded to bf16 once (to nearest even, as torch's cast)."""
    assert got.dtype == BF, what
    want = want32.to(BF)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
        f"{what}: {int((got.view(torch.int16) != want.view(torch.int16)).sum())} of {got.numel()} values differ"


# ---------------------------------------------------------------------------------------------
# Terms
# ---------------------------------------------------------------------------------------------

TERMS = term_cases()


def test_term_through_the_modules_in_bf16():
    """An iRPE module converted to bf16 on a bf16 input: the bf16 kernel, gradients bf16."""
    cfg = rpe_torch.get_rpe_config(ratio=1.0, method="product", mode="ctx", shared_head=True, skip=1, rpe_on="k")
    _, rk, _ = rpe_torch.build_rpe(cfg, head_dim=D, num_heads=H)
    with torch.no_grad():
        rk.lookup_table_weight.normal_()
    rk = rk.to(BF)
    q = rnd(B, H, 7, D, seed=4).detach().to(BF).requires_grad_()
    out = rk(q, 2, 3)
    assert out.dtype == BF
    out.float().sum().backward()
    assert q.grad.dtype == BF and rk.lookup_table_weight.grad.dtype == BF
    ref = ops.term_forward(q.detach().float(), [rk.lookup_table_weight.detach().float()], "product", "contextual", "k",
                           1.0, 2.0, 8.0, 1, 2, 3)
    assert_bits(out, ref, "module")


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------

ROPE_CASES = {n: a for n, (op, a) in op_cases().items() if op is ops.rope_forward}


# ---------------------------------------------------------------------------------------------
# Fused attention
# ---------------------------------------------------------------------------------------------

def _only_slots(params, *slots):
    """params with the term values of the slots (0 q, 1 k, 2 v) not in `slots` set to 0 (a slot without
    a method takes none: make_attention_args refuses them), the RoPE's params kept."""
    return [0.0 if i < 12 and i // 4 not in slots else p for i, p in enumerate(params)]


def _without_terms(a):
    a = list(a)
    a[3:6], a[6] = [[], [], []], ";".join([""] * 6 + a[6].split(";")[6:])  # spec: no term on any slot
    a[7] = _only_slots(a[7])
    return tuple(a)


def _bias_k(a):
    a = list(a)
    a[3:6], a[6] = [[], [rnd(H, 6, seed=61)], []], ";".join(["", "", "euclidean", "bias", "", ""] + a[6].split(";")[6:])
    a[7] = _only_slots(a[7], 1)
    return tuple(a)


def _cross_qkv(a):
    a = list(a)
    a[3:6] = ([rnd(1, D, 6, seed=62), rnd(1, D, 6, seed=63)], [rnd(H, D, 6, seed=64), rnd(H, D, 6, seed=65)],
              [rnd(1, 6, D, seed=66), rnd(1, 6, D, seed=67)])
    a[6] = ";".join(["cross", "contextual"] * 3 + a[6].split(";")[6:])
    return tuple(a)


ATTENTION = {
    "no_rpe": _without_terms(attention_args()),
    "ctx_qkv_product_masks": attention_args(),  # per-head k table, key padding and additive masks, scale
    "bias_k_euclidean": _bias_k(attention_args()),
    "ctx_qkv_cross": _cross_qkv(attention_args()),
    "rope_mixed": attention_args(rope="mixed"),
    "rope_axial": attention_args(rope="axial"),
    "rope_mixed_positions": rope_positions_attention_args("mixed"),
    "irpe_positions": index_attention_args("positions"),
    "key_lengths": index_attention_args("key_lengths"),
    "packed_grids": index_attention_args("packed_grids"),
}
# the portable path (float forward, outputs rounded once): RoPE, key lengths, packed sequences
PORTABLE = {"rope_mixed", "rope_axial", "rope_mixed_positions", "key_lengths", "packed_grids"}


def _buckets(a):
    return max([t.shape[-1] if t.dim() == 2 or i < 2 else t.shape[1] for i, ts in enumerate(a[3:6]) for t in ts] or [0])


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_attention_forward_bf16(name):
    b, f32, f64 = rounded(ATTENTION[name], KEEP["attention_forward"])
    out = ops.attention_forward(*b)
    assert out.dtype == BF and out.shape == b[0].shape and out.is_contiguous()
    ref = ops.attention_forward(*f64)
    v = f64[2]
    if name == "packed_grids":  # no probabilities output with packed sequences: Σⱼ pᵢⱼ|vⱼ| ≤ max|v|
        pv = torch.full_like(ref, float(v.abs().max()))
    else:
        out_a, attn = ops.attention_forward_attn(*b)
        assert torch.equal(out_a.view(torch.int16), out.view(torch.int16))  # the same output with attn
        ref_a, attn64 = ops.attention_forward_attn(*f64)
        assert attn.dtype == BF and attn.shape == attn64.shape
        assert float(((attn.double() - attn64).abs() - (U * attn64 + 1e-6)).max()) <= 0, name
        pv = attn64 @ v.abs()
    s = ref.abs() + pv
    err = (out.double() - ref).abs()
    ratio = float((err / (U * s + 1e-5 * (1 + s))).max())
    assert ratio <= 1, (name, ratio)
    if name in PORTABLE:
        assert_bits(out, ops.attention_forward(*f32), name)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------



def test_mixed_dtypes_are_refused_naming_the_argument():
    a = cast(attention_args(rope="mixed"), BF, KEEP["attention_forward"])

    def with_(i, value):
        return tuple(value if j == i else x for j, x in enumerate(a))
    f32, f64, bf = r"torch\.float32", r"torch\.float64", r"torch\.bfloat16"

    def err(name, dtype, ref, ref_dtype, shared=""):  # the message names both arguments, both dtypes, the rule
        return pytest.raises(TypeError, match=rf"\[rpe.torch\] {name} has dtype {dtype} but {ref} has {ref_dtype}; {shared}")
    with err("k", f32, "q", bf, r"q, k, v, the tables, a float attn_mask, rope_freqs, grad_out and attn must share one dtype"):
        ops.attention_forward(*with_(1, a[1].float()))
    with err(r"tables_k\[0\]", f32, "q", bf):
        ops.attention_forward(*with_(4, [a[4][0].float()]))
    with err("attn_mask", f64, "q", bf):
        ops.attention_forward(*with_(10, a[10].double()))
    with err("rope_freqs", f32, "q", bf):
        ops.attention_forward(*with_(12, a[12].float()))
    with err("q", f32, "k", bf, "q, k, v"):
        ops.attention_forward(*with_(0, a[0].float()))  # q alone of another dtype: q is the odd one, not k
    t = cast(term_cases()["ctx_k_product_shared"], BF)
    with err("x", f32, r"tables\[0\]", bf, "x, the tables and grad_out must share one dtype"):
        ops.term_forward(t[0].float(), *t[1:])  # the term operators' dtype is the tables'
    with err("grad_out", f32, r"tables\[0\]", bf):
        ops.term_backward(t[0], t[1], torch.zeros(B, H, 7, 7), *t[2:])
    x = rnd(B, H, 7, D, grad=False).to(BF)
    with err("freqs", f32, "x", bf, "x, freqs and grad_y must share one dtype"):
        ops.rope_forward(x, "mixed", [], torch.zeros(2, H, D // 2), 1, 2, 3)
    with err("grad_y", f32, "x", bf):
        ops.rope_backward(x, x.float(), "axial", [100.0], None, 1, 2, 3)
    with err("grad_table", bf, "raw", f32, "raw and grad_table must share one dtype"):
        ops.cpb_table_backward(torch.zeros(25, H), torch.zeros(H, 25, dtype=BF), 3, 3, True)
    with err(r"rel_pos_w", f64, "rel_pos_h", f32, "rel_pos_h and rel_pos_w must share one dtype"):
        ops.decomposed_tables(torch.zeros(5, D), torch.zeros(5, D, dtype=torch.float64), 3, 3, 0, False)
    with pytest.raises(TypeError, match=r"\[rpe.torch\] angles has dtype torch\.float64; expected torch\.float32 "
                                        r"\(rope_mixed_init computes in float32\)"):
        ops.rope_mixed_init(10.0, D, torch.zeros(H, dtype=torch.float64))
    # the public functions give the same messages
    mods = [m.to(BF) if m is not None else None for m in rpe_torch.build_rpe(
        rpe_torch.get_rpe_config(ratio=1.0, method="product", mode="ctx", skip=1, rpe_on="k"), head_dim=D, num_heads=H)]
    with err(r"tables_k\[0\]", bf, "q", f32):
        rpe_torch.attention(x.float(), x.float(), x.float(), *mods, height=2, width=3)


def test_table_operators_without_a_bf16_kernel_refuse_it():
    # the table operators without a bf16 kernel name theirs
    with pytest.raises(TypeError, match=r"\[rpe.torch\] raw has dtype torch\.bfloat16; expected float32 or float64"):
        ops.cpb_table(torch.zeros(15, H, dtype=BF), 2, 3, True)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

def _digits(which, fused, dtype):
    model, _ = build(rpe_torch, which, fused)
    x, _ = images()
    return model.to(dtype).train(), x[:8].to(dtype)


def _logits_and_grads(model, x, ctx=None, run=None):
    """Logits of run(x) (default: the model) under ctx, and the model's parameter gradients."""
    model.zero_grad(set_to_none=True)
    run = run if run is not None else model
    if ctx is None:
        out = run(x)
    else:
        with ctx:
            out = run(x)
    w = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
    (out.double() * w).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_rel(a, ref, floor=1e-30):
    """max |a − ref| / max(max |ref|, floor): the error as a fraction of the tensor's scale."""
    return float((a.double() - ref.double()).abs().max() / max(float(ref.double().abs().max()), floor))


def _worst_grad(grads, ref_grads):
    """The worst _max_rel over the parameters, each against the larger of its own scale and 1e-2 of
    the largest gradient (a gradient that vanishes in exact arithmetic, e.g. the key projection's
    bias under the softmax, is compared at that floor)."""
    top = max(float(g.double().abs().max()) for g in ref_grads.values())
    return max(_max_rel(grads[n], ref_grads[n], 1e-2 * top) for n in ref_grads)


#: The model tolerances (max error / max |float64 value|; measured worst in docs/torch.md):
#: bf16 everywhere (LayerNorm, GELU, softmax inputs, every activation rounded) for .to(bf16);
#: autocast keeps LayerNorm and the residual stream in float32.
#: Measured: 0.011, 0.088 (.to(bf16)); 0.0065, 0.031 (autocast).
MODEL_TOL = {"to_bf16": (0.03, 0.2), "autocast": (0.02, 0.1)}  # (logits, gradients)

MODELS = {"deit_irpe_k_fused": ("b", True), "deit_irpe_k_modules": ("b", False), "deit_irpe_qkv_fused": ("a", True),
          "deit_irpe_qkv_modules": ("a", False)}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_digits_deit_in_bf16(name):
    """model.to(torch.bfloat16): forward and backward in bf16 end to end, against float64; the
    predicted classes agree with float64's on the 8 images."""
    which, fused = MODELS[name]
    m64, x64 = _digits(which, fused, F64)
    ref, ref_grads = _logits_and_grads(m64, x64)
    m16, x16 = _digits(which, fused, BF)
    out, grads = _logits_and_grads(m16, x16)
    assert out.dtype == BF and all(g.dtype == BF for g in grads.values())
    assert grads.keys() == ref_grads.keys()
    tol_out, tol_grad = MODEL_TOL["to_bf16"]
    assert _max_rel(out, ref) <= tol_out, _max_rel(out, ref)
    worst = _worst_grad(grads, ref_grads)
    assert worst <= tol_grad, worst
    assert torch.equal(out.argmax(1), ref.argmax(1))


def _rope_model(dtype):
    torch.manual_seed(0)
    return RoPEBlock().to(dtype), torch.randn(2, 10, 16, dtype=torch.float64).to(dtype)


AUTOCAST_MODELS = {"deit_irpe_k_fused": lambda dt: _digits("b", True, dt),
                   "deit_irpe_k_modules": lambda dt: _digits("b", False, dt),
                   "deit_irpe_qkv_fused": lambda dt: _digits("a", True, dt), "rope_mixed_block": _rope_model}


@pytest.mark.parametrize("name", sorted(AUTOCAST_MODELS))
def test_cpu_autocast_bf16_models(name):
    """A float32 model under torch.autocast("cpu", dtype=torch.bfloat16): the rpe operators run
    their bf16 kernels (bf16 outputs), gradients reach the float32 parameters in float32; logits
    and gradients against the float64 model."""
    m64, x64 = AUTOCAST_MODELS[name](F64)
    ref, ref_grads = _logits_and_grads(m64, x64)
    m32, x32 = AUTOCAST_MODELS[name](torch.float32)
    out, grads = _logits_and_grads(m32, x32, torch.autocast("cpu", dtype=BF))
    assert out.dtype == (torch.float32 if name == "rope_mixed_block" else BF)  # the block adds its float32 input
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert grads.keys() == ref_grads.keys()
    tol_out, tol_grad = MODEL_TOL["autocast"]
    assert _max_rel(out, ref) <= tol_out, _max_rel(out, ref)
    worst = _worst_grad(grads, ref_grads)
    assert worst <= tol_grad, worst


def test_cpu_autocast_bf16_runs_the_bf16_kernels():
    """Under bf16 autocast an operator gives exactly the bf16 operator on its inputs cast to bf16
    (the float32 kernel rounded once would differ); RoPE's real positions are not rounded."""
    a32 = cast(attention_args(rope="mixed"), torch.float32)
    with torch.autocast("cpu", dtype=BF):
        out = ops.attention_forward(*a32)
        out_a = ops.attention_forward_attn(*a32)
    want = ops.attention_forward(*cast(a32, BF))
    assert out.dtype == BF and torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert all(t.dtype == BF for t in out_a)
    r32 = cast(ROPE_CASES["rope_forward[axial_half_positions]"], torch.float32, KEEP["rope_forward"])
    with torch.autocast("cpu", dtype=BF):
        y = ops.rope_forward(*r32)
    want = ops.rope_forward(*cast(r32, BF, KEEP["rope_forward"]))  # positions as given (float64)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    t32 = cast(term_cases()["ctx_v_euclidean"], torch.float32)
    with torch.autocast("cpu", dtype=BF):
        t = ops.term_forward(*t32)
    assert torch.equal(t.view(torch.int16), ops.term_forward(*cast(t32, BF)).view(torch.int16))
    # an operator without a bf16 kernel: float32 inside, the output in bf16
    raw = rnd(15, H, grad=False).float()
    with torch.autocast("cpu", dtype=BF):
        table = ops.cpb_table(raw, 2, 3, True)
    assert table.dtype == BF and torch.equal(table, ops.cpb_table(raw, 2, 3, True).to(BF))
    # float64 inputs are left alone
    a64 = attention_args()
    with torch.autocast("cpu", dtype=BF):
        assert ops.attention_forward(*a64).dtype == F64


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["to_bf16", "autocast"])
def test_compile_fullgraph_bf16(kind):
    """torch.compile(fullgraph=True) (a graph break raises) of the fused DeiT-iRPE-K in bf16 and
    under bf16 autocast: the same logits and gradients as eager, within bf16's own rounding."""
    torch._dynamo.reset()
    model, x = _digits("b", True, BF if kind == "to_bf16" else torch.float32)
    ctx = (lambda: torch.autocast("cpu", dtype=BF)) if kind == "autocast" else (lambda: None)
    eager, eager_grads = _logits_and_grads(model, x, ctx())
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out, grads = _logits_and_grads(model, x, ctx(), compiled)
    assert out.dtype == BF
    torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2)
    assert grads.keys() == eager_grads.keys()
    for n in grads:
        assert grads[n].dtype == eager_grads[n].dtype
        assert _max_rel(grads[n], eager_grads[n]) <= 0.05, n


@pytest.mark.parametrize("kind", ["swin_timm_layout", "alibi", "alibi_dtype"])
def test_vit_terms_in_bf16(kind):
    """The ViT term modules converted with .to(torch.bfloat16) in the attention: RelPosBias in
    timm's layout (table_from_timm in bf16, exact) and ALiBi2D's buffer (converted, or built with
    dtype=torch.bfloat16); bf16 output and table gradient, the attention within its bound of
    float64 on the same values."""
    torch.manual_seed(0)
    term = {"swin_timm_layout": lambda: rpe_torch.RelPosBias(3, H), "alibi": lambda: rpe_torch.ALiBi2D(H, 3, 3),
            "alibi_dtype": lambda: rpe_torch.ALiBi2D(H, 3, 3, dtype=BF)}[kind]()
    for p in term.parameters():
        torch.nn.init.normal_(p, std=0.5)
    q, k, v = (rnd(B, H, 9, D, seed=s).detach().to(BF) for s in (91, 92, 93))
    t16 = term.to(BF)
    out = rpe_torch.attention(q.requires_grad_(), k, v, None, t16, None, height=3, width=3)
    assert out.dtype == BF
    out.float().sum().backward()
    assert q.grad.dtype == BF and all(p.grad.dtype == BF for p in t16.parameters())
    t64 = t16.double()
    ref = rpe_torch.attention(q.detach().double(), k.double(), v.double(), None, t64, None, height=3, width=3)
    bound = U * (ref.abs() + v.double().abs().max()) + 1e-5 * (1 + ref.abs() + v.double().abs().max())
    assert bool(((out.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [BF, torch.float16])
def test_alibi_takes_every_dtype_that_to_takes(dtype):
    """ALiBi2D(..., dtype=d) for the low-precision dtypes that .to(d) converts it to: the float64
    table rounded once to d (hand-checked value: head 0 of 2 has slope 1/16, so the bucket of
    (Δr, Δc) = (1, 2) holds −√5/16); within one rounding of the float32 module converted with .to(d);
    a dtype that is not floating point is a TypeError naming it."""
    m = rpe_torch.ALiBi2D(2, 3, 3, skip=1, dtype=dtype)
    f64 = rpe_torch.ALiBi2D(2, 3, 3, skip=1, dtype=torch.float64).table
    assert m.table.dtype == dtype and m.table.shape == f64.shape
    assert torch.equal(m.table, f64.to(dtype))
    assert rpe_torch.alibi_slopes(2)[0] == 1 / 16
    k = 2 * 5 + 2 + 2 + 1  # bucket (Δr + 2)·5 + (Δc + 2) of the 5 × 5 offsets, (Δr, Δc) = (1, 2)
    assert float(f64[0, k]) == pytest.approx(-math.sqrt(5) / 16, rel=1e-15)
    assert m.table[0, k] == torch.tensor(-math.sqrt(5) / 16, dtype=torch.float64).to(dtype)
    conv = rpe_torch.ALiBi2D(2, 3, 3, skip=1).to(dtype).table
    assert conv.dtype == dtype
    assert float((m.table.double() - conv.double()).abs().max()) <= torch.finfo(dtype).eps * float(f64.abs().max())
    assert m().dtype == dtype
    assert torch.equal(m()[0, :, 1:, 1:], rpe_torch.ALiBi2D(2, 3, 3, skip=1).to(dtype)()[0, :, 1:, 1:])
    for bad in (torch.int64, torch.bool, torch.complex64, "bfloat16"):
        with pytest.raises(TypeError, match=r"\[rpe.torch\] dtype = .*; expected a floating-point torch.dtype"):
            rpe_torch.ALiBi2D(2, 3, 3, dtype=bad)


def test_float_only_table_modules_refuse_bf16_naming_the_argument():
    m = rpe_torch.DecomposedRelPos(3, 3, D).to(BF)
    q = rnd(B, H, 9, D, grad=False).to(BF)
    with pytest.raises(TypeError, match=r"\[rpe.torch\] rel_pos_h has dtype torch\.bfloat16; expected float32 or float64"):
        rpe_torch.attention(q, q, q, None, m, None, height=3, width=3)
    with torch.autocast("cpu", dtype=BF):  # autocast computes its tables in float32, then bf16
        assert rpe_torch.attention(q, q, q, None, m, None, height=3, width=3).dtype == BF


def test_save_attn_default_counts_bf16_bytes_under_autocast(monkeypatch):
    """save_attn=None keeps the probabilities (whatever the terms; a value term here) when they
    take at most 64 MiB: under CPU bf16 (or float16) autocast they are stored in bf16 (float16), 2 bytes, so
    float32 inputs are counted at 2 bytes, as bf16 inputs are. L = 4100 (a 41 × 100 grid), one head:
    67.2 MB in float32 (not kept), 33.6 MB in bf16 (kept)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4100, 8, generator=g, requires_grad=True)
    cfg = rpe_torch.get_rpe_config(ratio=1.9, method="product", mode="contextual", shared_head=True, skip=0, rpe_on="v")
    _, _, rpe_v = rpe_torch.build_rpe(cfg, head_dim=8, num_heads=1)

    def called():
        return attention_operators(monkeypatch, lambda: rpe_torch.attention(q, q, q, None, None, rpe_v, height=41, width=100))

    assert called() == ["attention_forward"]  # float32: 67.2 MB > 64 MiB
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert called() == ["attention_forward_attn"]
    with torch.autocast("cpu", dtype=torch.float16):  # the float16 kernel: counted at 2 bytes
        assert called() == ["attention_forward_attn"]


def _rope_block_bf16():
    """test_compile's RoPE-Mixed block with a bias term on k (dim 16, 2 heads, 3 × 3 grid + 1), in bf16."""
    torch.manual_seed(0)
    return RoPEBlock().to(BF).train(), torch.randn(2, 10, 16).to(BF)


def test_compile_inductor_fullgraph_bf16():
    """torch.compile(fullgraph=True) with the default backend (inductor: C++ code generation for the
    ops around the rpe operators, needs g++) of a bf16 RoPE-Mixed block with iRPE on k: no graph
    break, eager's output and parameter gradients within bf16 rounding (inductor may round the
    LayerNorm / Linear ops differently), every gradient in bf16."""
    torch._dynamo.reset()
    model, x = _rope_block_bf16()
    eager, eager_grads = _logits_and_grads(model, x)
    compiled = torch.compile(model, fullgraph=True)
    out, grads = _logits_and_grads(model, x, None, compiled)
    assert out.dtype == BF
    torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2)
    assert grads.keys() == eager_grads.keys() and "rope.freqs" in grads and "rpe_k.lookup_table_bias" in grads
    for n in grads:
        assert grads[n].dtype == BF, n
        assert _max_rel(grads[n], eager_grads[n]) <= 0.05, n


def test_export_bf16_round_trip(tmp_path):
    """torch.export of the bf16 block: the rpe operators in the graph with bf16 outputs, and
    torch.export.save / load give eager's output bit for bit."""
    model, x = _rope_block_bf16()
    model.eval()
    with torch.no_grad():
        expected = model(x)
    exported = torch.export.export(model, (x,))
    rpe_nodes = [n for n in exported.graph.nodes if n.op == "call_function" and str(n.target).startswith("rpe.")]
    # the attention (with the probabilities when export traces with grad enabled, as here)
    assert {str(n.target) for n in rpe_nodes} & {"rpe.attention_forward.default",
                                                  "rpe.attention_forward_attn.default"}, rpe_nodes
    vals = [v for n in rpe_nodes for v in (n.meta["val"] if isinstance(n.meta["val"], (list, tuple)) else [n.meta["val"]])]
    assert vals and all(v.dtype == BF for v in vals)
    path = tmp_path / "rope_block_bf16.pt2"
    torch.export.save(exported, path)
    out = torch.export.load(path).module()(x)
    assert out.dtype == BF
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("family", ["deit", "rope_mixed"])
def test_timm_swap_in_bf16(family):
    """timm's own model (test_timm's tiny DeiT / rope-vit RoPE-Mixed) converted to bf16, with
    rpe_torch.timm.swap_attention: bf16 logits and gradients as close to the float64 model as
    timm's own bf16 forward is (within twice its error, or 2e-2 / 5e-2 of the scale)."""
    pytest.importorskip("timm")
    import copy

    import rpe_torch.timm as rtimm
    from test_timm import FAMILIES, make, run
    name, kwargs = FAMILIES[family]
    ref64 = make(name, kwargs)
    timm16 = copy.deepcopy(ref64).to(BF)
    swapped16 = rtimm.swap_attention(copy.deepcopy(ref64)).to(BF)
    assert rtimm.swapped(swapped16)
    torch.manual_seed(1)
    x = torch.randn(2, 3, *ref64.patch_embed.img_size, dtype=torch.float64)
    out64, grads64 = run(ref64, x, False)
    out_t, grads_t = run(timm16, x.to(BF), False)
    out_s, grads_s = run(swapped16, x.to(BF), False)
    assert out_s.dtype == BF and all(g.dtype == BF for g in grads_s.values())
    assert grads_s.keys() == grads64.keys()
    err_s, err_t = _max_rel(out_s, out64), _max_rel(out_t, out64)
    assert err_s <= max(2 * err_t, 2e-2), (err_s, err_t)
    gerr_s, gerr_t = _worst_grad(grads_s, grads64), _worst_grad(grads_t, grads64)
    assert gerr_s <= max(2 * gerr_t, 5e-2), (gerr_s, gerr_t)
