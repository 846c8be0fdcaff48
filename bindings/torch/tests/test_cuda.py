"""rpe_torch's CUDA operators (bindings/torch/src/ops_cuda.cpp, over rpe's CUDA backend) against
its CPU operators: every term kind, the fused attention (iRPE on q, k, v, Cross, bias, masks,
scale, RoPE axial / mixed / cat alone and with iRPE) and the standalone RoPE, values and
gradients (through autograd: the backward operators too), in float32 and float64, and in
float16 / bfloat16 against the CPU's float32 on the same rounded inputs; the iRPE terms and the
attention at per-token positions, with valid key lengths and on packed sequences (float64); the
errors (mixed devices, features rpe's CUDA backend lacks, operators without a CUDA kernel, dtypes).

Every test that needs a device skips when ``torch.cuda.is_available()`` is False (they run on a
lent GPU through scripts/gpu_check.sh --torch). Without a device, test_cuda_kernels_registered
checks, when CTest says the library was built with them (RPE_TORCH_EXPECT_CUDA=1), that the CUDA
kernels are registered and that the operators without one refuse with their message; the CUDA
autocast rules (AutocastCUDA kernels, registered by rpe_torch whatever the library) are checked
on CPU tensors through the dispatcher, and under torch.autocast("cuda") on a device.

Tolerances (docs/torch.md, as docs/cuda.md's for the C++ backend, twice as wide for fp16 / bf16):
``|gpu − cpu| ≤ ε·(|cpu| + rms(cpu))`` per element with ε = 8·u·√N (float32, float64; the CPU
result in the same dtype) or 4·u·√N (float16 u = 2⁻¹¹, bfloat16 u = 2⁻⁸; the CPU result in
float32 from the same fp16 / bf16-rounded inputs), u the unit roundoff, N the longest sum behind
an element: D for a q / k term, L + K·D for a value term, B·H·L² for a table gradient; the
attention's output and q, k, v gradients use N = D + L with 16·u (float) and 8·u (fp16 / bf16).
"""
import itertools
import math
import os

import pytest
import torch

import rpe_torch as rt
from conftest import attention_backward_op_args as GB  # attention_backward's grouped arguments
from rpe_torch._registrations import attention_op_args as G  # the attention operators' grouped arguments

#: The device the comparisons run on: "cuda"; "cpu" only to check this file's harness on a
#: machine without a GPU (RPE_TORCH_TEST_DEVICE=cpu: CPU against CPU, float32 / float64, no error
#: test), never a test of the CUDA kernels.
DEVICE = os.environ.get("RPE_TORCH_TEST_DEVICE", "cuda")
DRY_RUN = DEVICE == "cpu"
HAS_GPU = torch.cuda.is_available() or DRY_RUN
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device (torch.cuda.is_available() is False)")
pytestmark_kernels = pytest.mark.skipif(not DRY_RUN and HAS_GPU and not rt.has_cuda_kernels(),
                                        reason="the operator library was built without its CUDA kernels (RPE_TORCH_CUDA=OFF)")
not_dry = pytest.mark.skipif(DRY_RUN, reason="RPE_TORCH_TEST_DEVICE=cpu: the harness check runs no error test")

RATIO = 1.0  # alpha 1, beta 2, gamma 8: small tables
METHODS = ["euclidean", "quantization", "product", "cross"]
UNIT = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
LOW = (torch.float16, torch.bfloat16)


def eps(dtype, n, attention=False):
    """ε of the rule in the module docstring for dtype and sum length n."""
    factor = (16 if attention else 8) if dtype not in LOW else (8 if attention else 4)
    return factor * UNIT[dtype] * math.sqrt(max(n, 1))


def assert_matches(gpu, cpu, dtype, n, what, attention=False):
    """|gpu − cpu| ≤ ε·(|cpu| + rms(cpu)) elementwise (compared in float64 on the CPU)."""
    assert gpu.device.type == DEVICE, f"{what}: on {gpu.device}, expected {DEVICE}"
    assert gpu.dtype == dtype, f"{what}: dtype {gpu.dtype}, expected {dtype}"
    assert gpu.is_contiguous(), f"{what}: not contiguous (the fake kernels promise contiguous outputs)"
    a, e = gpu.detach().cpu().double(), cpu.detach().cpu().double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)}, expected {tuple(e.shape)}"
    rms = e.pow(2).mean().sqrt() if e.numel() else torch.tensor(0.0, dtype=torch.float64)
    tol = eps(dtype, n, attention) * (e.abs() + rms)
    diff = (a - e).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    assert bool(torch.all(diff <= tol)), f"{what}: max |gpu - cpu| = {worst:.3e} exceeds ε = {eps(dtype, n, attention):.2e}"


def devices_dtype(dtype):
    """Skips fp16 / bf16 in the CPU harness check (no CPU kernel of them)."""
    if DRY_RUN and dtype in LOW:
        pytest.skip("RPE_TORCH_TEST_DEVICE=cpu: no fp16 / bf16 CPU kernel")


def reference_dtype(dtype):
    """The CPU operators' dtype for a CUDA run in dtype: float32 for fp16 / bf16 (no CPU kernel)."""
    return torch.float32 if dtype in LOW else dtype


def on_gpu(t, dtype):
    """(the CUDA copy in dtype, the CPU reference copy of the same rounded values), both leaves
    requiring grad when t does."""
    g = t.detach().to(DEVICE, dtype)
    c = g.detach().cpu().to(reference_dtype(dtype))
    if t.requires_grad:
        g.requires_grad_()
        c.requires_grad_()
    return g, c


def num_buckets(method, skip):
    base = rt.get_num_buckets({"euclidean": 0, "quantization": 1, "product": 3, "cross": 4}[method], RATIO, 2 * RATIO,
                              8 * RATIO)
    return base + (1 if skip else 0)


# ---------------------------------------------------------------------------------------------
# Without a device
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(os.environ.get("RPE_TORCH_EXPECT_CUDA") != "1",
                    reason="RPE_TORCH_EXPECT_CUDA is not 1 (set by CTest when the library is built with RPE_TORCH_CUDA)")
def test_cuda_kernels_registered():
    """The library built with RPE_TORCH_CUDA has a CUDA kernel for every tensor operator: the
    real ones, and for the others one that names what is missing (called here through the
    dispatcher's CUDA key, no device needed)."""
    assert rt.has_cuda_kernels()
    for op in ("term_forward", "term_backward", "attention_forward", "attention_forward_attn", "attention_backward",
               "rope_forward", "rope_backward", "table_from_timm", "cpb_table", "resize_rel_pos", "decomposed_tables"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"rpe::{op}", "CUDA"), op
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    # the table operators' CUDA kernel runs the CPU one (here with nothing to copy)
    t = torch.randn(3, 2)
    assert torch.equal(torch.ops.rpe.table_from_timm.default.redispatch(cuda, t), t.t())
    rows, cols = torch.ops.rpe.decomposed_tables.default.redispatch(cuda, torch.randn(3, 4), torch.randn(5, 4), 2, 3, 0, False)
    assert rows.shape == cols.shape == (1, 4, 5)
    q = torch.zeros(1, 1, 4, 4)
    # attention_forward_attn's refusal comes after the device checks (test_errors_name_the_argument
    # sees it with CUDA tensors); CPU tensors alone are named as such
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] no argument is a CUDA tensor"):
        torch.ops.rpe.attention_forward_attn.default.redispatch(cuda, *G(q, q, q, [], [], [], "", "", "", "", "", "",
                                                                [0.0] * 12, 2, 2, None, None))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] tables is empty"):
        torch.ops.rpe.term_forward.default.redispatch(cuda, None, [], "product", "bias", "k", 1.0, 2.0, 8.0, 0, 2, 2)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] no argument is a CUDA tensor"):
        torch.ops.rpe.term_forward.default.redispatch(cuda, None, [torch.zeros(1, 26)], "product", "bias", "k", 1.0, 2.0,
                                                      8.0, 0, 2, 2)


# ---------------------------------------------------------------------------------------------
# CUDA autocast: the rules run without a device (the AutocastCUDA kernels on CPU tensors)
# ---------------------------------------------------------------------------------------------

AUTOCAST_CUDA = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)


class cuda_autocast_dtype:
    """torch.get_autocast_dtype("cuda") set to dtype inside (restored after)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __enter__(self):
        self.old = torch.get_autocast_dtype("cuda")
        torch.set_autocast_dtype("cuda", self.dtype)

    def __exit__(self, *exc):
        torch.set_autocast_dtype("cuda", self.old)


def test_cuda_autocast_kernels_registered():
    """Every forward operator that takes floating tensors has an AutocastCUDA kernel, for the C++
    dispatcher and the Python one (torch.compile, export); the backward operators have none (they
    run in the forward's dtypes). Independent of the library's CUDA kernels and of a device."""
    from rpe_torch._registrations import AUTOCAST_OPS
    assert {"term_forward", "attention_forward", "rope_forward", "cpb_table", "decomposed_tables"} <= set(AUTOCAST_OPS)
    for name in AUTOCAST_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"rpe::{name}", "AutocastCUDA"), name
        assert torch._C.DispatchKey.AutocastCUDA in getattr(torch.ops.rpe, name).default.py_kernels, name
    for name in ("term_backward", "attention_backward", "rope_backward"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"rpe::{name}", "AutocastCUDA"), name


def test_cuda_autocast_rules_on_cpu_tensors():
    """The AutocastCUDA kernels, called through the dispatcher on CPU tensors: float16 and bfloat16
    autocast cast the operators with CUDA fp16 / bf16 kernels (terms, attention, RoPE) to that dtype
    (on CPU tensors the cast runs the CPU float16 / bf16 kernel: bit for bit the operator on the
    cast inputs); the table
    operators without one compute in float32 and return the autocast dtype (the float32 result
    rounded once); float64 is left alone."""
    from rpe_torch._registrations import autocast_compute_dtype
    for name in ("term_forward", "attention_forward", "rope_forward"):
        for dt in LOW:
            assert autocast_compute_dtype(name, "cuda", dt) == dt, (name, dt)
        assert autocast_compute_dtype(name, "cpu", torch.float16) == torch.float16, name
    assert autocast_compute_dtype("table_from_timm", "cuda", torch.bfloat16) == torch.bfloat16
    assert autocast_compute_dtype("table_from_timm", "cuda", torch.float16) == torch.float32
    assert autocast_compute_dtype("cpb_table", "cuda", torch.bfloat16) == torch.float32
    ops = torch.ops.rpe
    g = torch.Generator().manual_seed(3)
    table = torch.randn(2, 26, generator=g)
    term = ("product", "bias", "k", 1.0, 2.0, 8.0, 1, 2, 3, None, None)
    raw, rel_h, rel_w = torch.randn(25, 2, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    with cuda_autocast_dtype(torch.float16):
        out = ops.term_forward.default.redispatch(AUTOCAST_CUDA, None, [table], *term)
        assert out.dtype == torch.float16 and torch.equal(out, ops.term_forward(None, [table.half()], *term))
        out = ops.cpb_table.default.redispatch(AUTOCAST_CUDA, raw, 3, 3, True)
        assert out.dtype == torch.float16 and torch.equal(out, ops.cpb_table(raw, 3, 3, True).half())
        out = ops.table_from_timm.default.redispatch(AUTOCAST_CUDA, table.t().bfloat16())  # bf16 up-cast, exact
        assert out.dtype == torch.float16 and torch.equal(out, table.bfloat16().float().half())
        out = ops.cpb_table.default.redispatch(AUTOCAST_CUDA, raw.double(), 3, 3, True)
        assert out.dtype == torch.float64 and torch.equal(out, ops.cpb_table(raw.double(), 3, 3, True))
    with cuda_autocast_dtype(torch.bfloat16):
        out = ops.term_forward.default.redispatch(AUTOCAST_CUDA, None, [table], *term)
        assert out.dtype == torch.bfloat16 and torch.equal(out, ops.term_forward(None, [table.bfloat16()], *term))
        out = ops.term_forward.default.redispatch(AUTOCAST_CUDA, None, [table.half()], *term)  # fp16 cast to bf16 too
        assert torch.equal(out, ops.term_forward(None, [table.half().bfloat16()], *term))
        rows, cols = ops.decomposed_tables.default.redispatch(AUTOCAST_CUDA, rel_h, rel_w, 3, 3, 0, False)
        r32, c32 = ops.decomposed_tables(rel_h, rel_w, 3, 3, 0, False)
        assert rows.dtype == cols.dtype == torch.bfloat16
        assert torch.equal(rows, r32.bfloat16()) and torch.equal(cols, c32.bfloat16())


@needs_gpu
@not_dry
@pytestmark_kernels
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_cuda_autocast_runs_the_low_precision_kernels(dtype):
    """A float32 iRPE-QKV attention under torch.autocast("cuda", dtype): the fp16 / bf16 CUDA
    kernels run (bit for bit the attention on the dtype-cast inputs and tables; sums in float32),
    the output is in dtype, the float32 leaves and parameters get float32 gradients; within the
    low-precision tolerance of the CPU float32 attention on the same values; a table operator
    without a kernel of dtype (cpb_table) computes in float32 on the host and returns dtype."""
    g = torch.Generator().manual_seed(11)
    B, H, h, w, D = 2, 2, 3, 3, 8
    L = 1 + h * w
    cfg = rt.get_rpe_config(ratio=RATIO, method="product", mode="ctx", skip=1, rpe_on="qkv")
    mods = [m for m in rt.build_rpe(cfg, head_dim=D, num_heads=H)]
    with torch.no_grad():  # values exact in dtype: the cast inside autocast is then exact too
        for m in mods:
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g).to(dtype).float())
    qkv = [torch.randn(B, H, L, D, generator=g).to(dtype).float() for _ in range(3)]
    mods_g = [copy_module(m).to(DEVICE) for m in mods]
    leaves = [t.to(DEVICE).requires_grad_() for t in qkv]
    with torch.autocast("cuda", dtype=dtype):
        out = rt.attention(*leaves, *mods_g, height=h, width=w)
    assert out.dtype == dtype
    expected = rt.attention(*(t.detach().to(dtype) for t in leaves), *[copy_module(m).to(dtype) for m in mods_g],
                            height=h, width=w)
    assert torch.equal(out, expected)
    assert_matches(out, rt.attention(*qkv, *mods, height=h, width=w), dtype, D + L, "out (autocast)", attention=True)
    out.float().sum().backward()
    assert all(t.grad.dtype == torch.float32 for t in leaves)
    assert all(p.grad.dtype == torch.float32 for m in mods_g for p in m.parameters())
    raw = torch.randn(25, H, generator=g).to(DEVICE)
    with torch.autocast("cuda", dtype=dtype):
        t = torch.ops.rpe.cpb_table(raw, 3, 3, True)
    assert t.dtype == dtype and t.device.type == "cuda"
    assert torch.equal(t, torch.ops.rpe.cpb_table(raw, 3, 3, True).to(dtype))


# ---------------------------------------------------------------------------------------------
# Terms
# ---------------------------------------------------------------------------------------------

TERM_KINDS = [("bias", "k"), ("contextual", "k"), ("contextual", "v")]
TERM_CASES = [(m, kind, shared, skip) for m, kind, shared, skip in itertools.product(METHODS, TERM_KINDS, [True, False], [0, 1])
              if (shared, skip) in ((True, 1), (False, 0)) or m == "product"]


def term_inputs(method, mode, target, shared, skip, B=2, H=3, h=3, w=4, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    L, K = skip + h * w, num_buckets(method, skip)
    ht = 1 if shared else H
    shape = (ht, K) if mode == "bias" else ((ht, K, D) if target == "v" else (ht, D, K))
    tables = [torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2 if method == "cross" else 1)]
    if mode == "bias":
        x = None
    elif target == "v":
        x = torch.softmax(torch.randn(B, H, L, L, generator=g, dtype=torch.float64), -1).requires_grad_()
    else:
        x = torch.randn(B, H, L, D, generator=g, dtype=torch.float64).requires_grad_()
    return x, tables, (B, H, L, D, K, h, w)


@needs_gpu
@pytestmark_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("method,kind,shared,skip", TERM_CASES)
def test_term_matches_cpu(method, kind, shared, skip, dtype):
    devices_dtype(dtype)
    mode, target = kind
    x, tables, (B, H, L, D, K, h, w) = term_inputs(method, mode, target, shared, skip)
    xg, xc = on_gpu(x, dtype) if x is not None else (None, None)
    pairs = [on_gpu(t, dtype) for t in tables]
    tg, tc = [p[0] for p in pairs], [p[1] for p in pairs]
    args = (method, mode, target, RATIO, 2 * RATIO, 8 * RATIO, skip, h, w)
    out_g, out_c = rt.term(xg, tg, *args), rt.term(xc, tc, *args)
    n = (L + K * D) if target == "v" else D
    assert_matches(out_g, out_c, dtype, n if mode == "contextual" else 1, "out")
    grad = torch.randn(out_c.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grad_g = grad.to(DEVICE, dtype)  # both sides get the same rounded incoming gradient
    (out_g * grad_g).sum().backward()
    (out_c * grad_g.cpu().to(out_c.dtype)).sum().backward()
    for i, (a, b) in enumerate(zip(tg, tc)):
        assert_matches(a.grad, b.grad, dtype, B * H * L * L, f"grad tables[{i}]")
    if x is not None:
        assert_matches(xg.grad, xc.grad, dtype, K * (D if target == "v" else 1) + L, "grad x")


@needs_gpu
@pytestmark_kernels
@pytest.mark.parametrize("method,window", [("swin", (3, 4)), ("beit", (3, 4))])
def test_vit_bias_terms_match_cpu(method, window):
    """The Swin / BEiT bias terms by name (the device computes their ids with the host's math)."""
    skip = 1 if method == "beit" else 0
    K = (2 * window[0] - 1) * (2 * window[1] - 1) + (3 if method == "beit" else 0)
    table = torch.randn(3, K, generator=torch.Generator().manual_seed(2), dtype=torch.float64).requires_grad_()
    tg, tc = on_gpu(table, torch.float64)
    args = (method, "bias", "k", window[0], window[1], 0, skip, window[0], window[1])
    out_g, out_c = rt.term(None, [tg], *args), rt.term(None, [tc], *args)
    assert_matches(out_g, out_c, torch.float64, 1, "out")
    out_g.sum().backward()
    out_c.sum().backward()
    assert_matches(tg.grad, tc.grad, torch.float64, out_c.numel(), "grad table")


# ---------------------------------------------------------------------------------------------
# Fused attention
# ---------------------------------------------------------------------------------------------

ATTENTION_CASES = {
    # name: (method, mode, rpe_on, shared, skip, extra)
    "plain": ("product", "contextual", "", True, 1, {}),
    "ctx_k_product": ("product", "contextual", "k", True, 1, {}),
    "ctx_qkv_product_perhead": ("product", "contextual", "qkv", False, 1, {}),
    "bias_qk_euclidean": ("euclidean", "bias", "qk", False, 0, {}),
    "ctx_qkv_cross": ("cross", "contextual", "qkv", True, 1, {}),
    "ctx_qkv_quant_masked": ("quantization", "contextual", "qkv", True, 1, {"kpm": True}),
    "ctx_qkv_attn_mask": ("product", "contextual", "qkv", True, 0, {"attn_mask": "float"}),
    "ctx_k_bool_mask": ("product", "contextual", "k", True, 0, {"attn_mask": "bool"}),
    "ctx_qkv_scale": ("product", "contextual", "qkv", True, 1, {"scale": 0.37}),
    "strided_qkv": ("product", "contextual", "qkv", True, 1, {"strided": True}),
    "rope_axial": ("product", "contextual", "", True, 1, {"rope": "axial"}),
    "rope_mixed_ctx_k": ("product", "contextual", "k", True, 1, {"rope": "mixed"}),
    "rope_cat_half": ("product", "contextual", "", True, 1, {"rope": "cat_half"}),
    "rope_dinov3_bias_k": ("euclidean", "bias", "k", False, 1, {"rope": "dinov3"}),
}


def make_rope(kind, H, D):
    if kind == "axial":
        return rt.RoPEAxial(theta=100.0, skip=1)
    if kind == "mixed":
        return rt.RoPEMixed(num_heads=H, head_dim=D, theta=10.0, skip=1)
    if kind == "dinov3":
        return rt.RoPEDinoV3(D, skip=1)
    return rt.RoPECat(skip=1, layout="half")


def attention_case(name, dtype, B=2, H=3, h=4, w=5, D=16):
    """(CUDA call, CPU call, parameters on the GPU, on the CPU, (B, H, L, D)): the two sides get
    the same rounded inputs; every call returns the output."""
    method, mode, rpe_on, shared, skip, extra = ATTENTION_CASES[name]
    mid = {"euclidean": 0, "quantization": 1, "product": 3, "cross": 4}[method]
    cfg = rt.get_rpe_config(ratio=RATIO, method=mid, mode=mode, shared_head=shared, skip=skip, rpe_on=rpe_on)
    ref = reference_dtype(dtype)
    g = torch.Generator().manual_seed(11)
    mods_c = rt.build_rpe(cfg, head_dim=D, num_heads=H)
    rope_c = make_rope(extra["rope"], H, D) if "rope" in extra else None
    with torch.no_grad():
        for m in [*mods_c, rope_c]:
            if m is not None:
                for p in m.parameters():
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.3 if m is rope_c else 1.0))
    mods_g = [m.to(DEVICE, dtype) if m is not None else None for m in (copy_module(m) for m in mods_c)]
    rope_g = copy_module(rope_c).to(DEVICE, dtype) if rope_c is not None else None
    # the CPU side from the GPU side's rounded parameters
    mods_c = [m.to(ref) if m is not None else None for m in mods_c]
    with torch.no_grad():
        for mc, mg in zip([*mods_c, rope_c], [*mods_g, rope_g]):
            if mc is not None:
                for pc, pg in zip(mc.parameters(), mg.parameters()):
                    pc.copy_(pg.detach().cpu().to(pc.dtype))
    if rope_c is not None:
        rope_c = rope_c.to(ref)
    L = skip + h * w
    qkv = [torch.randn(B, H, L, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3)]
    if extra.get("strided"):  # permuted views of a (B, L, 3, H, D) projection on both sides
        packed = torch.randn(B, L, 3, H, D, generator=g, dtype=torch.float64)
        qkv = [packed[:, :, i].permute(0, 2, 1, 3) for i in range(3)]
    sides = []
    for device, dt, mods, rope in ((DEVICE, dtype, mods_g, rope_g), ("cpu", ref, mods_c, rope_c)):
        if extra.get("strided"):
            base = packed.to(DEVICE, dtype).to(device).to(dt).requires_grad_()
            q, k, v = (base[:, :, i].permute(0, 2, 1, 3) for i in range(3))
            leaves = [base]
        else:
            q, k, v = (t.detach().to(DEVICE, dtype).to(device).to(dt).requires_grad_() for t in qkv)
            leaves = [q, k, v]
        kw = {"height": h, "width": w, "rope": rope}
        if extra.get("kpm"):
            kpm = torch.zeros(B, L, dtype=torch.bool)
            kpm[1, -3:] = True
            kw["key_padding_mask"] = kpm.to(device)
        if extra.get("attn_mask") == "float":
            kw["attn_mask"] = torch.randn(L, L, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(
                DEVICE, dtype).to(device).to(dt)
        if extra.get("attn_mask") == "bool":
            m = torch.zeros(L, L, dtype=torch.bool)
            m[:, -2:] = True
            m[-1, -3] = True
            kw["attn_mask"] = m.to(device)
        if "scale" in extra:
            kw["scale"] = extra["scale"]
        params = [p for mod in [*mods, rope] if mod is not None for p in mod.parameters()]
        sides.append((lambda q=q, k=k, v=v, mods=mods, kw=kw: rt.attention(q, k, v, *mods, **kw), leaves, params))
    return sides, (B, H, L, D)


def copy_module(m):
    import copy
    return copy.deepcopy(m) if m is not None else None


def random_float64_modules(cfg, D, H, g):
    """build_rpe's modules for cfg in float64 with every parameter drawn from g (N(0, 1)), and
    their copies on DEVICE (None where cfg attaches no term)."""
    mods_c = [m.double() if m is not None else None for m in rt.build_rpe(cfg, head_dim=D, num_heads=H)]
    with torch.no_grad():
        for m in mods_c:
            if m is not None:
                for p in m.parameters():
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return mods_c, [copy_module(m).to(DEVICE) if m is not None else None for m in mods_c]


def check_float64_attention(out_g, out_c, qkv_g, qkv_c, g, n):
    """A float64 attention on the GPU against the CPU's: the outputs, then the backward of both for
    one incoming gradient drawn from generator g (after the outputs' check), and grad q, k, v
    (qkv_g, qkv_c: the leaves of each side), each with the attention tolerance for n terms."""
    assert_matches(out_g, out_c, torch.float64, n, "out", attention=True)
    grad = torch.randn(out_c.shape, generator=g, dtype=torch.float64)
    (out_c * grad).sum().backward()
    (out_g * grad.to(DEVICE)).sum().backward()
    for a, b, name in zip(qkv_g, qkv_c, ("grad q", "grad k", "grad v")):
        assert_matches(a.grad, b.grad, torch.float64, n, name, attention=True)


def compare_float64_attention(mods_c, mods_g, kw_c, kw_g, g, shape, lk=None):
    """rt.attention on the CPU (mods_c, kw_c) and on DEVICE (mods_g, kw_g) of the same random
    float64 q (B, H, L, D), k and v (B, H, L_k, D) (`shape` (B, H, L, D); L_k = lk, default L)
    drawn from g: outputs and q, k, v gradients (check_float64_attention), then every table's
    gradient; returns DEVICE's (q, k, v) leaves."""
    B, H, L, D = shape
    lk = L if lk is None else lk
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64).requires_grad_() for n in (L, lk, lk))
    qg, kg, vg = (t.detach().to(DEVICE).requires_grad_() for t in (q, k, v))
    out_c = rt.attention(q, k, v, *mods_c, save_attn=False, **kw_c)
    out_g = rt.attention(qg, kg, vg, *mods_g, **kw_g)
    check_float64_attention(out_g, out_c, (qg, kg, vg), (q, k, v), g, D + max(L, lk))
    params_g = [p for m in mods_g if m is not None for p in m.parameters()]
    params_c = [p for m in mods_c if m is not None for p in m.parameters()]
    for a, b in zip(params_g, params_c):
        assert_matches(a.grad, b.grad, torch.float64, B * H * L * lk, f"grad table {tuple(a.shape)}")
    return qg, kg, vg


@needs_gpu
@pytestmark_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_attention_matches_cpu(name, dtype):
    devices_dtype(dtype)
    ((call_g, leaves_g, params_g), (call_c, leaves_c, params_c)), (B, H, L, D) = attention_case(name, dtype)
    out_g, out_c = call_g(), call_c()
    assert_matches(out_g, out_c, dtype, D + L, "out", attention=True)
    grad = torch.randn(out_c.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    grad_g = grad.to(DEVICE, dtype)  # both sides get the same rounded incoming gradient
    (out_g * grad_g).sum().backward()
    (out_c * grad_g.cpu().to(out_c.dtype)).sum().backward()
    for i, (a, b) in enumerate(zip(leaves_g, leaves_c)):
        assert_matches(a.grad, b.grad, dtype, D + L, f"grad input {i}", attention=True)
    assert len(params_g) == len(params_c)
    for i, (a, b) in enumerate(zip(params_g, params_c)):
        assert_matches(a.grad, b.grad, dtype, B * H * L * L, f"grad parameter {i} {tuple(a.shape)}")


@needs_gpu
@not_dry
@pytestmark_kernels
def test_attention_on_a_side_stream_and_under_no_grad():
    """The operators enqueue on torch's current stream (here a side stream; its result read after
    synchronising that stream) and, without grad, never ask for the probabilities."""
    (call_g, _, _), (call_c, _, _) = attention_case("ctx_qkv_product_perhead", torch.float32)[0]
    expected = call_c()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        out = call_g()
    s.synchronize()
    assert_matches(out, expected, torch.float32, 16 + 21, "out (side stream)", attention=True)


class _CompiledBlock(torch.nn.Module):
    """A pre-norm attention block on rpe_torch.attention: RoPE-Mixed (learned frequencies) and
    contextual iRPE on q, k and v (Product, per-head tables, a class token), 3 × 3 grid."""

    def __init__(self, dim=16, heads=2, side=3):
        super().__init__()
        self.heads, self.side = heads, side
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.rope = rt.RoPEMixed(heads, dim // heads, skip=1)
        cfg = rt.get_rpe_config(ratio=RATIO, method="product", mode="ctx", shared_head=False, skip=1, rpe_on="qkv")
        self.rpe_q, self.rpe_k, self.rpe_v = rt.build_rpe(cfg, dim // heads, heads)
        with torch.no_grad():
            for m in (self.rpe_q, self.rpe_k, self.rpe_v):
                m.lookup_table_weight.normal_(std=0.5)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = rt.attention(q, k, v, self.rpe_q, self.rpe_k, self.rpe_v, height=self.side, width=self.side, rope=self.rope)
        return x + self.proj(out.transpose(1, 2).reshape(b, n, c))


@needs_gpu
@pytestmark_kernels
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_on_cuda(backend):
    """torch.compile(fullgraph=True) of a block whose attention runs on the CUDA operators (their
    fake kernels trace it; inductor generates the GPU code around them): no graph break, the output
    and every parameter gradient equal to eager on the same device (float64)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _CompiledBlock().double().to(DEVICE)
    x = torch.randn(2, 10, 16, dtype=torch.float64, device=DEVICE)

    def run(f):
        model.zero_grad(set_to_none=True)
        out = f(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=DEVICE).reshape(out.shape)).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager_out, eager_grads = run(model)
    out, grads = run(torch.compile(model, fullgraph=True, backend=backend))  # fullgraph: a graph break raises
    assert out.device.type == DEVICE
    torch.testing.assert_close(out, eager_out, atol=1e-10, rtol=1e-10)
    assert grads.keys() == eager_grads.keys()
    assert sum("lookup_table_weight" in n for n in grads) == 3 and any(n.startswith("rope.") for n in grads), list(grads)
    for n in grads:
        torch.testing.assert_close(grads[n], eager_grads[n], atol=1e-10, rtol=1e-10, msg=n)


@needs_gpu
@not_dry
@pytestmark_kernels
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one CUDA device (the second-device case needs two)")
def test_second_device():
    """Tensors on cuda:1 run on cuda:1 (device guard), whatever the current device."""
    x, tables, (B, H, L, D, K, h, w) = term_inputs("product", "contextual", "k", True, 1)
    args = ("product", "contextual", "k", RATIO, 2 * RATIO, 8 * RATIO, 1, h, w)
    out = rt.term(x.detach().to("cuda:1", torch.float32), [tables[0].detach().to("cuda:1", torch.float32)], *args)
    assert out.device == torch.device("cuda:1")
    assert_matches(out, rt.term(x.detach().float(), [tables[0].detach().float()], *args), torch.float32, D, "out")


# ---------------------------------------------------------------------------------------------
# RoPE alone
# ---------------------------------------------------------------------------------------------

@needs_gpu
@pytestmark_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["axial", "mixed", "cat_half", "dinov3"])
def test_rope_matches_cpu(kind, dtype):
    devices_dtype(dtype)
    B, H, h, w, D = 2, 3, 4, 5, 16
    rope_c = make_rope(kind, H, D)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in rope_c.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    rope_g = copy_module(rope_c).to(DEVICE, dtype)
    with torch.no_grad():
        for pc, pg in zip(rope_c.parameters(), rope_g.parameters()):
            pc.copy_(pg.detach().cpu().to(pc.dtype))
    rope_c = rope_c.to(reference_dtype(dtype))
    x = torch.randn(B, H, 1 + h * w, D, generator=g, dtype=torch.float64).requires_grad_()
    xg, xc = on_gpu(x, dtype)
    out_g, out_c = rope_g(xg, h, w), rope_c(xc, h, w)
    assert_matches(out_g, out_c, dtype, 4, "out")
    grad = torch.randn(out_c.shape, generator=g, dtype=torch.float64)
    grad_g = grad.to(DEVICE, dtype)  # both sides get the same rounded incoming gradient
    (out_g * grad_g).sum().backward()
    (out_c * grad_g.cpu().to(out_c.dtype)).sum().backward()
    assert_matches(xg.grad, xc.grad, dtype, 4, "grad x")
    for a, b in zip(rope_g.parameters(), rope_c.parameters()):
        assert_matches(a.grad, b.grad, dtype, B * h * w, "grad freqs")


def make_rope_suffix(kind, H, D, suffix):
    """A RoPE module with skip 1 and `suffix` trailing tokens (D = 16: mrope's sections 2 + 3 + 3)."""
    if kind == "axial":
        return rt.RoPEAxial(theta=100.0, skip=1, suffix=suffix)
    if kind == "mixed":
        return rt.RoPEMixed(num_heads=H, head_dim=D, theta=10.0, skip=1, suffix=suffix)
    if kind == "dinov3":
        return rt.RoPEDinoV3(D, skip=1, suffix=suffix)
    if kind == "mrope":
        return rt.RoPEMRoPE(sections=(2, 3, 3), theta=100.0, skip=1, suffix=suffix)
    if kind == "vjepa2":  # D = 16: slices of 4 channels, the last 4 channels unrotated
        return rt.RoPEVJEPA2(theta=100.0, skip=1, suffix=suffix)
    return rt.RoPECat(skip=1, layout="half", suffix=suffix)


@needs_gpu
@pytestmark_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("where", ["grid", "cuda", "cpu"])
@pytest.mark.parametrize("kind", ["axial", "mixed", "cat_half", "dinov3", "mrope", "vjepa2"])
def test_rope_positions_and_suffix_match_cpu(kind, where, dtype):
    """The CUDA rotation with suffix tokens, on the grid or at random real positions (on the
    device or the CPU), forward and backward (mixed's frequencies included), against the CPU's."""
    devices_dtype(dtype)
    B, H, h, w, D, suffix = 2, 3, 3, 4, 16, 2
    axes = 3 if kind in ("mrope", "vjepa2") else 2
    rope_c = make_rope_suffix(kind, H, D, suffix)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in rope_c.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    rope_g = copy_module(rope_c).to(DEVICE, dtype)
    rope_c = rope_c.to(reference_dtype(dtype))
    pos = None if where == "grid" else torch.rand(h * w, axes, generator=g) * 5 - 1
    pos_g = None if pos is None else (pos.to(DEVICE) if where == "cuda" else pos)
    x = torch.randn(B, H, 1 + h * w + suffix, D, generator=g, dtype=torch.float64).requires_grad_()
    xg, xc = on_gpu(x, dtype)
    out_g, out_c = rope_g(xg, h, w, positions=pos_g), rope_c(xc, h, w, positions=pos)
    assert_matches(out_g, out_c, dtype, 4, "out")
    assert torch.equal(out_g[:, :, 1 + h * w:].cpu(), xg[:, :, 1 + h * w:].detach().cpu())  # the suffix: copied
    grad = torch.randn(out_c.shape, generator=g, dtype=torch.float64)
    grad_g = grad.to(DEVICE, dtype)
    (out_g * grad_g).sum().backward()
    (out_c * grad_g.cpu().to(out_c.dtype)).sum().backward()
    assert_matches(xg.grad, xc.grad, dtype, 4, "grad x")
    for a, b in zip(rope_g.parameters(), rope_c.parameters()):
        assert_matches(a.grad, b.grad, dtype, B * h * w, "grad freqs")


@needs_gpu
@pytestmark_kernels
@pytest.mark.parametrize("kind", ["axial", "mixed", "mrope", "vjepa2"])
def test_attention_rope_positions_match_cpu(kind):
    """The CUDA attention with RoPE at per-token positions for q and other positions for k, and
    suffix tokens, forward and backward, against the CPU attention (float64)."""
    B, H, h, w, D, suffix = 2, 2, 3, 4, 16, 1
    axes = 3 if kind in ("mrope", "vjepa2") else 2
    L = 1 + h * w + suffix
    rope_c = make_rope_suffix(kind, H, D, suffix).double()
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in rope_c.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    rope_g = copy_module(rope_c).to(DEVICE)
    pos, kpos = (torch.rand(h * w, axes, generator=g) * 5 - 1 for _ in range(2))
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    qg, kg, vg = (t.detach().to(DEVICE).requires_grad_() for t in (q, k, v))
    out_c = rt.attention(q, k, v, rope=rope_c, height=h, width=w, positions=pos, key_positions=kpos)
    out_g = rt.attention(qg, kg, vg, rope=rope_g, height=h, width=w, positions=pos.to(DEVICE),
                         key_positions=kpos.to(DEVICE))
    check_float64_attention(out_g, out_c, (qg, kg, vg), (q, k, v), g, D + L)
    for a, b in zip(rope_g.parameters(), rope_c.parameters()):
        assert_matches(a.grad, b.grad, torch.float64, B * L * L, "grad freqs")


# ---------------------------------------------------------------------------------------------
# iRPE at per-token positions, valid key lengths
# ---------------------------------------------------------------------------------------------

def irpe_positions(n, axes, irregular, seed):
    """(n, axes) int64 positions: a permuted h x w grid's coordinates (n = h·w, axes 2), or random
    integers in [-3, 5] (repeats, gaps, negative values)."""
    g = torch.Generator().manual_seed(seed)
    if irregular:
        return torch.randint(-3, 6, (n, axes), generator=g)
    grid = torch.stack(torch.meshgrid(torch.arange(3), torch.arange(n // 3), indexing="ij"), -1).reshape(-1, 2)
    return grid[torch.randperm(n, generator=g)]


@needs_gpu
@pytestmark_kernels
@pytest.mark.parametrize("where", ["cuda", "cpu"])
@pytest.mark.parametrize("keys_apart", [False, True])
@pytest.mark.parametrize("method,kind", [("product", ("bias", "k")), ("product", ("contextual", "k")),
                                         ("product", ("contextual", "v")), ("cross", ("contextual", "k"))])
def test_term_at_positions_matches_cpu(method, kind, keys_apart, where):
    """rt.term at per-token positions (int64 on q's device or on the CPU; key positions apart or
    not), forward and backward, against the CPU operator at the same positions (float64)."""
    mode, target = kind
    x, tables, (B, H, L, D, K, h, w) = term_inputs(method, mode, target, True, 1)
    n = L - 1
    pos = irpe_positions(n, 2, keys_apart, 21)
    kpos = irpe_positions(n, 2, True, 22) if keys_apart else None
    dev = DEVICE if where == "cuda" else "cpu"
    xg, xc = on_gpu(x, torch.float64) if x is not None else (None, None)
    pairs = [on_gpu(t, torch.float64) for t in tables]
    tg, tc = [p[0] for p in pairs], [p[1] for p in pairs]
    args = (method, mode, target, RATIO, 2 * RATIO, 8 * RATIO, 1, 1, 1)
    out_g = rt.term(xg, tg, *args, positions=pos.to(dev), key_positions=kpos.to(dev) if keys_apart else None)
    out_c = rt.term(xc, tc, *args, positions=pos, key_positions=kpos)
    n_sum = (L + K * D) if target == "v" else D
    assert_matches(out_g, out_c, torch.float64, n_sum if mode == "contextual" else 1, "out")
    grad = torch.randn(out_c.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (out_g * grad.to(DEVICE)).sum().backward()
    (out_c * grad).sum().backward()
    for i, (a, b) in enumerate(zip(tg, tc)):
        assert_matches(a.grad, b.grad, torch.float64, B * H * L * L, f"grad tables[{i}]")
    if x is not None:
        assert_matches(xg.grad, xc.grad, torch.float64, K * (D if target == "v" else 1) + L, "grad x")


@needs_gpu
@pytestmark_kernels
@pytest.mark.parametrize("where", ["cuda", "cpu"])
@pytest.mark.parametrize("case", ["positions", "key_positions", "key_lengths", "positions_and_key_lengths"])
def test_attention_at_positions_and_key_lengths_matches_cpu(case, where):
    """rt.attention with iRPE on q, k, v at per-token positions (rpe_positions, rpe_key_positions)
    and / or valid key lengths (key_lengths), each on q's device or on the CPU, forward and
    backward, against the CPU attention (float64); padded keys get exactly zero grad k and v."""
    B, H, h, w, D, skip = 2, 2, 3, 4, 16, 1
    L = skip + h * w
    cfg = rt.get_rpe_config(ratio=RATIO, method=3, mode="contextual", shared_head=True, skip=skip, rpe_on="qkv")
    g = torch.Generator().manual_seed(13)
    mods_c, mods_g = random_float64_modules(cfg, D, H, g)
    dev = DEVICE if where == "cuda" else "cpu"
    kw_c = {}
    if case in ("positions", "positions_and_key_lengths"):
        kw_c["rpe_positions"] = irpe_positions(h * w, 2, False, 31)
    if case == "key_positions":
        kw_c["rpe_positions"] = irpe_positions(h * w, 2, True, 32)
        kw_c["rpe_key_positions"] = irpe_positions(h * w, 2, True, 33)
    if "positions" not in kw_c:
        kw_c.update(height=h, width=w)
    if case in ("key_lengths", "positions_and_key_lengths"):
        kw_c["key_lengths"] = torch.tensor([L - 3, L])
    kw_g = {k: (t.to(dev) if isinstance(t, torch.Tensor) else t) for k, t in kw_c.items()}
    _, kg, vg = compare_float64_attention(mods_c, mods_g, kw_c, kw_g, g, (B, H, L, D))
    if "key_lengths" in kw_c:
        assert bool(torch.all(kg.grad[0, :, L - 3:] == 0)) and bool(torch.all(vg.grad[0, :, L - 3:] == 0))


@needs_gpu
@pytestmark_kernels
@pytest.mark.parametrize("where", ["cuda", "cpu"])
@pytest.mark.parametrize("case", ["more_keys", "fewer_keys_padding_lengths"])
def test_attention_keys_of_another_length_match_cpu(case, where):
    """rt.attention with iRPE on q, k, v and keys of another count than the queries (L_k != L:
    rpe_positions (L - skip), rpe_key_positions (L_k - skip), on q's device or the CPU), with a
    key padding mask and key_lengths of L_k, forward and backward, against the CPU (float64)."""
    B, H, h, w, D, skip = 2, 2, 3, 4, 16, 1
    L = skip + h * w
    nk = 40 if case == "more_keys" else 5
    Lk = skip + nk
    cfg = rt.get_rpe_config(ratio=RATIO, method=3, mode="contextual", shared_head=True, skip=skip, rpe_on="qkv")
    g = torch.Generator().manual_seed(17)
    mods_c, mods_g = random_float64_modules(cfg, D, H, g)
    dev = DEVICE if where == "cuda" else "cpu"
    kw_c = {"rpe_positions": irpe_positions(h * w, 2, False, 41), "rpe_key_positions": irpe_positions(nk, 2, True, 42)}
    if case == "fewer_keys_padding_lengths":
        mask = torch.zeros(B, Lk, dtype=torch.bool)
        mask[1, -2:] = True
        kw_c.update(key_padding_mask=mask, key_lengths=torch.tensor([Lk - 1, Lk]))
    kw_g = {k: t.to(dev) if k != "key_padding_mask" else t.to(DEVICE) for k, t in kw_c.items()}
    _, kg, vg = compare_float64_attention(mods_c, mods_g, kw_c, kw_g, g, (B, H, L, D), Lk)
    assert kg.shape == (B, H, Lk, D)
    if "key_lengths" in kw_c:
        assert bool(torch.all(kg.grad[0, :, Lk - 1:] == 0)) and bool(torch.all(vg.grad[0, :, Lk - 1:] == 0))
    # the operators' own messages, as on the CPU: a term with L_k != L needs both positions
    qd, kd = torch.zeros(B, H, L, D, device=DEVICE, dtype=torch.float64), torch.zeros(B, H, Lk, D, device=DEVICE,
                                                                                         dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rpe_key_positions is not given with keys of another length"):
        rt.attention(qd, kd, kd, *mods_g, rpe_positions=kw_g["rpe_positions"])
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rpe_q is attached with keys of another length than the "
                                         rf"queries \(L = {L}, L_k = {Lk}\) and no rpe_positions"):
        rt.attention(qd, kd, kd, *mods_g, height=h, width=w)


@needs_gpu
@pytestmark_kernels
@pytest.mark.parametrize("kind", ["axial", "mixed"])
def test_sam2_memory_attention_matches_cpu(kind):
    """SAM2's memory attention in one CUDA call: queries on an h x w grid (rope_query_suffix=0),
    keys the grid repeated R times (rope key_positions) and P unrotated pointer tokens (the rope's
    suffix), an (L, L_k) mask; forward, q, k, v gradients and RoPE-Mixed's frequency gradient
    against the CPU (float64)."""
    B, H, h, w, D, R, P = 2, 2, 3, 4, 16, 3, 4
    L, Lk = h * w, R * h * w + P
    rope_c = (rt.RoPEAxial(theta=10000.0, suffix=P) if kind == "axial" else
              rt.RoPEMixed(num_heads=H, head_dim=D, theta=10.0, suffix=P)).double()
    g = torch.Generator().manual_seed(23)
    with torch.no_grad():
        for p in rope_c.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    rope_g = copy_module(rope_c).to(DEVICE)
    grid = torch.stack([torch.arange(L) // w, torch.arange(L) % w], 1)
    kp = grid.repeat(R, 1)
    mask = torch.randn(L, Lk, generator=g, dtype=torch.float64)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(B, H, Lk, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    qg, kg, vg = (t.detach().to(DEVICE).requires_grad_() for t in (q, k, v))
    out_c = rt.attention(q, k, v, rope=rope_c, height=h, width=w, key_positions=kp, rope_query_suffix=0, attn_mask=mask)
    out_g = rt.attention(qg, kg, vg, rope=rope_g, height=h, width=w, key_positions=kp.to(DEVICE), rope_query_suffix=0,
                         attn_mask=mask.to(DEVICE))
    assert out_g.shape == (B, H, L, D)
    check_float64_attention(out_g, out_c, (qg, kg, vg), (q, k, v), g, D + Lk)
    assert kg.grad[:, :, -P:].abs().sum() > 0  # the pointer keys (unrotated) are attended
    for a, b in zip(rope_g.parameters(), rope_c.parameters()):
        assert_matches(a.grad, b.grad, torch.float64, B * L * Lk, "grad freqs")


PACKED_IMAGES = [(2, 3), (3, 4), (1, 5)]  # (height, width) of the packed test's 3 images


@needs_gpu
@pytestmark_kernels
@pytest.mark.parametrize("where", ["cuda", "cpu"])
@pytest.mark.parametrize("case", ["grids_contextual_qkv", "positions_contextual_qkv", "grids_bias_qk_padding"])
def test_attention_packed_matches_cpu(case, where):
    """rt.attention on packed sequences (3 images of different grids in one sequence, a class
    token each: packed_lengths with packed_grids or packed_positions, on q's device or on the CPU;
    iRPE contextual on q, k, v, or bias on q and k with a key padding mask), forward and backward,
    against the CPU attention's packed call (float64)."""
    B, H, D, skip = 2, 2, 16, 1
    lengths = [skip + h * w for h, w in PACKED_IMAGES]
    L = sum(lengths)
    bias = case.startswith("grids_bias")
    cfg = rt.get_rpe_config(ratio=RATIO, method="product", mode="bias" if bias else "contextual", shared_head=not bias,
                            skip=skip, rpe_on="qk" if bias else "qkv")
    g = torch.Generator().manual_seed(17)
    mods_c, mods_g = random_float64_modules(cfg, D, H, g)
    dev = DEVICE if where == "cuda" else "cpu"
    kw_c = {"packed_lengths": torch.tensor(lengths)}
    if case.startswith("positions"):
        grids = [torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
                 for h, w in PACKED_IMAGES]  # each image's grid positions, permuted
        kw_c["packed_positions"] = torch.cat([p[torch.randperm(p.shape[0], generator=g)] for p in grids])
    else:
        kw_c["packed_grids"] = torch.tensor(PACKED_IMAGES)
    kw_g = {k: t.to(dev) for k, t in kw_c.items()}
    if bias:  # the last key of the second and third images padded in batch element 0
        mask = torch.zeros(B, L, dtype=torch.bool)
        mask[0, lengths[0] + lengths[1] - 1] = mask[0, L - 1] = True
        kw_c["key_padding_mask"], kw_g["key_padding_mask"] = mask, mask.to(DEVICE)
    compare_float64_attention(mods_c, mods_g, kw_c, kw_g, g, (B, H, L, D))


# ---------------------------------------------------------------------------------------------
# Table operators (on the host)
# ---------------------------------------------------------------------------------------------

@needs_gpu
@not_dry
@pytestmark_kernels
def test_table_operators_run_on_the_host_for_cuda_tensors():
    """The ViT table operators take CUDA tensors (copied to the host and back): results on the
    device equal the CPU's bit for bit, gradients reach the CUDA parameters; and the ViT term
    modules that make their tables so (Swin in timm's layout, SAM's decomposed) run in the
    attention on CUDA as on the CPU."""
    g = torch.Generator().manual_seed(8)
    raw = torch.randn(25, 2, generator=g, dtype=torch.float64)
    for fn, args in ((rt.cpb_table, ((3, 3),)), (rt.table_from_timm, ())):
        x = raw.detach().cuda().requires_grad_()
        out = fn(x, *args)
        assert out.device == x.device and torch.equal(out.cpu(), fn(raw, *args))
        out.sum().backward()
        xc = raw.detach().requires_grad_()
        fn(xc, *args).sum().backward()
        assert torch.equal(x.grad.cpu(), xc.grad)
    B, H, h, w, D = 2, 2, 3, 3, 8
    for make in (lambda: rt.RelPosBias((h, w), H).double(), lambda: rt.DecomposedRelPos(h, w, D).double()):
        mod_c = make()
        with torch.no_grad():
            for p in mod_c.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        mod_g = copy_module(mod_c).cuda()
        q, k, v = (torch.randn(B, H, h * w, D, generator=g, dtype=torch.float64) for _ in range(3))
        out_c = rt.attention(q, k, v, rpe_k=mod_c)
        out_g = rt.attention(q.cuda(), k.cuda(), v.cuda(), rpe_k=mod_g)
        assert_matches(out_g, out_c, torch.float64, D + h * w, f"{type(mod_c).__name__} out", attention=True)
        out_g.sum().backward()
        out_c.sum().backward()
        for a, b in zip(mod_g.parameters(), mod_c.parameters()):
            assert_matches(a.grad, b.grad, torch.float64, B * H * (h * w) ** 2, f"{type(mod_c).__name__} grad")


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

@needs_gpu
@not_dry
@pytestmark_kernels
def test_errors_name_the_argument():
    B, H, h, w, D = 1, 2, 2, 3, 8
    L = 1 + h * w
    q, k, v = (torch.randn(B, H, L, D, device="cuda") for _ in range(3))
    cfg = rt.get_rpe_config(ratio=RATIO, method="product", mode="ctx", shared_head=True, skip=1, rpe_on="k")
    rpe_k = rt.build_rpe(cfg, head_dim=D, num_heads=H)[1]  # CPU tables
    # mixed devices: a CPU table with CUDA q, a CPU x with CUDA tables
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] tables_k\[0\] is on device cpu; expected cuda:0, the device of q"):
        rt.attention(q, k, v, None, rpe_k, None, height=h, width=w)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] x is on device cpu; expected cuda:0, the device of tables\[0\]"):
        torch.ops.rpe.term_forward(q.cpu(), [rpe_k.lookup_table_weight.detach().cuda()], "product", "contextual", "k",
                                   RATIO, 2 * RATIO, 8 * RATIO, 1, h, w)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] k is on device cpu; expected cuda:0, the device of q"):
        rt.attention(q, k.cpu(), v, height=h, width=w)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] key_padding_mask is on device cpu; expected cuda:0"):
        rt.attention(q, k, v, height=h, width=w, key_padding_mask=torch.zeros(B, L, dtype=torch.bool))
    rpe_k = rpe_k.cuda()
    # the tensor named is the odd one out: q, k, v on the CPU and the table alone on the GPU
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] tables_k\[0\] is on device cuda:0; expected cpu, the device of q"):
        rt.attention(q.cpu(), k.cpu(), v.cpu(), None, rpe_k, None, height=h, width=w)
    # what rpe's CUDA backend does not have
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] save_attn = True is not supported on CUDA"):
        rt.attention(q.requires_grad_(), k, v, None, rpe_k, None, height=h, width=w, save_attn=True)
    with pytest.raises(NotImplementedError, match=r"rpe::attention_forward_attn \(the attention's probabilities output, "
                                                  r"rpe_torch\.attention\(save_attn=True\)\) is not supported by the cuda backend"):
        torch.ops.rpe.attention_forward_attn(*G(q, k, v, [], [], [], "", "", "", "", "", "", [0.0] * 12, h, w, None, None))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] attn \(the forward's saved probabilities\) is not supported"):
        torch.ops.rpe.attention_backward(*GB(q, k, v, [], [], [], "", "", "", "", "", "", [0.0] * 12, h, w, None, None, None,
                                         q, attn=torch.zeros(B, H, L, L, device="cuda")))
    pos = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
    # RoPE positions: on the CPU or q's device; CUDA positions with CPU tensors are refused
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] positions is on device cuda:0; expected cpu, the device of"):
        rt.RoPEAxial(skip=1)(q.cpu(), positions=pos.cuda())
    tail = ("", [], None, 0, "pairs", None, None, 0)
    # packed sequences: on the CPU or q's device, checked by the library on the host
    with pytest.raises(ValueError, match=r"\[rpe\.attention\] packed\.lengths sum to 8; expected L = 7 of q"):
        rt.attention(q, k, v, None, rpe_k, None, packed_lengths=torch.tensor([L + 1], device="cuda"),
                     packed_grids=torch.tensor([[h, w]], device="cuda"))
    with pytest.raises(ValueError, match=r"\[rpe\.attention\] rpe_k is attached with packed but neither packed.grids"):
        rt.attention(q, k, v, None, rpe_k, None, packed_lengths=torch.tensor([L]))
    # the iRPE terms' positions and key lengths: on the CPU or q's device, integer
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] rpe_positions has dtype torch\.float32; expected an integer"):
        rt.attention(q, k, v, None, rpe_k, None, rpe_positions=pos.float().cuda())
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] key_lengths has dtype torch\.float32; expected an integer"):
        torch.ops.rpe.attention_forward(*G(q, k, v, [], [], [], "", "", "", "", "", "", [0.0] * 12, h, w, None, None,
                                        None, *tail, None, None, None, None, None, torch.full((B,), float(L), device="cuda")))
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] positions has dtype torch\.float32; expected an integer"):
        torch.ops.rpe.term_forward(None, [torch.zeros(H, 26, device="cuda")], "product", "bias", "k", 1.0, 2.0, 8.0, 1,
                                   h, w, pos.float().cuda())
    with pytest.raises(ValueError, match=r"\[rpe\.attention\] key_lengths"):  # the library's check, on the host
        rt.attention(q, k, v, None, rpe_k, None, height=h, width=w, key_lengths=torch.full((B,), L + 1, device="cuda"))
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match=r"\[rpe\.torch\] key_lengths is on device cuda:1; expected cpu or cuda:0"):
            rt.attention(q, k, v, None, rpe_k, None, height=h, width=w, key_lengths=torch.full((B,), L, device="cuda:1"))
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] rope positions has shape \(5, 2\); expected \(6, 2\)"):
        torch.ops.rpe.rope_forward(q, "axial", [100.0], None, 1, h, w, "pairs", pos[:5].cuda())  # the library's check
    with pytest.raises(ValueError, match=r"\[rpe\.cpb\] raw has shape \(15, 2\); expected \(25, 2\)"):
        torch.ops.rpe.cpb_table(torch.zeros(15, 2, device="cuda"), 3, 3, True)  # the CPU kernel's check, on the host
    # dtypes and the library's own checks, as on the CPU
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] q has dtype torch\.int32; expected float32, float64, float16 or bfloat16"):
        rt.attention(q.int(), k, v, height=h, width=w)
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] k has dtype torch\.float64 but q has torch\.float32; q, k, v, the tables"):
        rt.attention(q, k.double(), v, height=h, width=w)
    with pytest.raises(ValueError, match=r"\[rpe\.attention\] v has shape"):
        rt.attention(q, k, v[..., :4], height=h, width=w)
    with pytest.raises(ValueError, match=r"\[rpe\.attention\]"):  # D = 256 > 128: beyond the CUDA kernels
        big = torch.randn(1, 1, L, 256, device="cuda")
        rt.attention(big, big, big, height=h, width=w)
