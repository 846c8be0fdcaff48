"""rpe_torch operators: torch.autograd.gradcheck in float64 for every term kind and the fused
attention, bad input → Python exceptions naming the parameter, the drop-in contract
(reference names, shapes, defaults, state_dict)."""
import copy
import itertools

import pytest
import torch

import rpe_torch as irpe
from conftest import attention_backward_op_args as GB  # attention_backward's grouped arguments
from rpe_torch._registrations import attention_op_args as G  # the attention operators' grouped arguments

RATIO = 1.0  # alpha 1, beta 2, gamma 8: 5 buckets per axis, small tables for gradcheck
METHODS = ["euclidean", "quantization", "product", "cross"]


def num_buckets(method, skip):
    base = irpe.get_num_buckets({"euclidean": 0, "quantization": 1, "product": 3, "cross": 4}[method], RATIO,
                                2 * RATIO, 8 * RATIO)
    return base + (1 if skip else 0)


def tables(method, mode, target, ht, d, skip, seed):
    g = torch.Generator().manual_seed(seed)
    k = num_buckets(method, skip)
    shape = (ht, k) if mode == "bias" else ((ht, k, d) if target == "v" else (ht, d, k))
    n = 2 if method == "cross" else 1
    return [torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_() for _ in range(n)]


TERM_KINDS = [("bias", "k"), ("contextual", "k"), ("contextual", "v")]


@pytest.mark.parametrize("method,kind,shared,skip",
                         [(m, k, s, sk) for m, k, s, sk in itertools.product(METHODS, TERM_KINDS, [True, False], [0, 1])
                          if (s, sk) in ((True, 1), (False, 0)) or m == "product"])
def test_term_gradcheck(method, kind, shared, skip):
    mode, target = kind
    B, H, h, w, D = 2, 2, 2, 3, 3
    L = skip + h * w
    ts = tables(method, mode, target, 1 if shared else H, D, skip, seed=7)
    g = torch.Generator().manual_seed(3)
    if mode == "bias":
        x = None
    elif target == "v":
        x = torch.softmax(torch.randn(B, H, L, L, generator=g, dtype=torch.float64), -1).requires_grad_()
    else:
        x = torch.randn(B, H, L, D, generator=g, dtype=torch.float64).requires_grad_()

    def f(x, *ts):
        return irpe.term(x, list(ts), method, mode, target, RATIO, 2 * RATIO, 8 * RATIO, skip, h, w)

    out = f(x, *ts)
    expected = (1, len(ts) and ts[0].shape[0], L, L) if mode == "bias" else ((B, H, L, D) if target == "v" else (B, H, L, L))
    assert tuple(out.shape) == expected
    assert out.abs().sum() > 0
    inputs = ((x,) if x is not None else (None,)) + tuple(ts)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-6)


ATTENTION_CASES = {
    # name: (method, mode, rpe_on, shared, skip, extra)
    "plain": ("product", "contextual", "", True, 1, {}),
    "ctx_k_product": ("product", "contextual", "k", True, 1, {}),
    "ctx_qkv_product_perhead": ("product", "contextual", "qkv", False, 1, {}),
    "bias_qk_euclidean": ("euclidean", "bias", "qk", False, 0, {}),
    "ctx_qkv_cross": ("cross", "contextual", "qkv", True, 1, {}),
    "ctx_qkv_quant_masked": ("quantization", "contextual", "qkv", True, 1, {"kpm": True}),
    "ctx_qkv_attn_mask": ("product", "contextual", "qkv", True, 0, {"attn_mask": True}),
    "ctx_qkv_scale": ("product", "contextual", "qkv", True, 1, {"scale": 0.37}),
    "bias_q_scale": ("product", "bias", "qk", True, 1, {"scale": 0.8}),
}


def attention_setup(method, mode, rpe_on, shared, skip, H=2, D=3, h=2, w=3, B=2, dtype=torch.float64, seed=0):
    mid = {"euclidean": 0, "quantization": 1, "product": 3, "cross": 4}[method]
    cfg = irpe.get_rpe_config(ratio=RATIO, method=mid, mode=mode, shared_head=shared, skip=skip, rpe_on=rpe_on)
    mods = [m.to(dtype) if m is not None else None for m in irpe.build_rpe(cfg, head_dim=D, num_heads=H)]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in mods:
            if m is not None:
                for p in m.parameters():
                    p.copy_(torch.randn(p.shape, generator=g, dtype=dtype))
    L = skip + h * w
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    return mods, q, k, v, L


@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_attention_gradcheck(name):
    method, mode, rpe_on, shared, skip, extra = ATTENTION_CASES[name]
    h, w = 2, 3
    mods, q, k, v, L = attention_setup(method, mode, rpe_on, shared, skip, h=h, w=w)
    params = [p for m in mods if m is not None for p in m.parameters()]
    assert len(params) == sum(len(list(m.parameters())) for m in mods if m is not None)
    kpm = None
    if extra.get("kpm"):
        kpm = torch.zeros(2, L, dtype=torch.bool)
        kpm[1, -2:] = True
    attn_mask = None
    if extra.get("attn_mask"):
        attn_mask = torch.randn(L, L, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    scale = extra.get("scale")

    def f(q, k, v, *ps):  # ps are the modules' own parameters: gradcheck perturbs them in place
        return irpe.attention(q, k, v, *mods, height=h, width=w, key_padding_mask=kpm, attn_mask=attn_mask, scale=scale)

    out = f(q, k, v, *params)
    assert out.shape == q.shape
    # against a plain PyTorch evaluation of the reference's formula
    s = scale if scale is not None else q.shape[-1] ** -0.5
    logits = (q * s) @ k.transpose(-2, -1)
    if mods[1] is not None:
        logits = logits + mods[1](q * s, h, w)
    if mods[0] is not None:
        logits = logits + mods[0](k * s, h, w).transpose(2, 3)
    if attn_mask is not None:
        logits = logits + attn_mask
    if kpm is not None:
        logits = logits.masked_fill(kpm[:, None, None, :], float("-inf"))
    a = torch.softmax(logits, -1)
    ref = a @ v + (mods[2](a, h, w) if mods[2] is not None else 0)
    assert torch.allclose(out, ref, atol=1e-12, rtol=1e-10), (out - ref).abs().max()
    # Every Jacobian column for one case with all three per-head slots; the others in gradcheck's
    # fast mode (the Jacobians compared along random directions: the same failures, a fraction of
    # the time with ~300 inputs).
    fast = name != "ctx_qkv_product_perhead"
    assert torch.autograd.gradcheck(f, (q, k, v, *params), eps=1e-6, atol=1e-7, rtol=1e-6, fast_mode=fast)


def test_attention_float32_matches_float64():
    mods, q, k, v, L = attention_setup("product", "contextual", "qkv", True, 1)
    out64 = irpe.attention(q, k, v, *mods, height=2, width=3)
    mods32 = [m.float() for m in mods]
    out32 = irpe.attention(q.detach().float(), k.detach().float(), v.detach().float(), *mods32, height=2, width=3)
    assert out32.dtype == torch.float32
    assert torch.allclose(out32.double(), out64, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------

def test_errors_name_the_parameter():
    mods, q, k, v, L = attention_setup("product", "contextual", "qkv", True, 1, dtype=torch.float32)
    rq, rk, rv = mods
    with pytest.raises(TypeError, match=r"\[rpe.torch\] k has dtype torch\.float64 but q has torch\.float32; "
                                        r"q, k, v, the tables, a float attn_mask, rope_freqs, grad_out and attn must share one dtype"):
        irpe.attention(q, k.double(), v, rq, rk, rv, height=2, width=3)
    with pytest.raises(TypeError, match=r"tables_k\[0\] has dtype torch\.float64 but q has torch\.float32"):
        irpe.attention(q, k, v, rq, copy.deepcopy(rk).double(), rv, height=2, width=3)
    with pytest.raises(ValueError, match=r"L = 7 < height\*width = 3\*3"):
        irpe.attention(q, k, v, rq, rk, rv, height=3, width=3)
    with pytest.raises(ValueError, match=r"give both or neither"):
        irpe.attention(q, k, v, rq, rk, rv, height=2)
    with pytest.raises(ValueError, match=r"L = 7 is not skip \+ a square \(skip = 1\)"):
        rk(q)  # 7 = 1 + 6: not square, and no grid given
    with pytest.raises(ValueError, match=r"\[rpe.attention\] v has shape"):
        irpe.attention(q, k, v[:, :, :, :2], rq, rk, rv, height=2, width=3)
    with pytest.raises(ValueError, match=r"key_padding_mask has shape"):
        irpe.attention(q, k, v, rq, rk, rv, height=2, width=3, key_padding_mask=torch.zeros(3, L, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[rpe.torch\] x has shape"):
        rk(q[0], 2, 3)
    with pytest.raises(ValueError, match=r"device meta"):
        irpe.attention(q.to("meta"), k, v, rq, rk, rv, height=2, width=3)
    with pytest.raises(ValueError, match=r"tables\[0\] is on device meta"):
        irpe.term(q, [rk.lookup_table_weight.to("meta")], "product", "contextual", "k", RATIO, 2 * RATIO, 8 * RATIO,
                  1, 2, 3)
    with pytest.raises(TypeError, match=r"tables\[0\] is a list"):
        irpe.term(q, [[1.0]], "product", "contextual", "k", RATIO, 2 * RATIO, 8 * RATIO, 1, 2, 3)
    with pytest.raises(TypeError, match=r"rpe_k is a Linear"):
        irpe.attention(q, k, v, None, torch.nn.Linear(2, 2), None, height=2, width=3)
    with pytest.raises(ValueError, match=r"scale = -1"):
        irpe.attention(q, k, v, rq, rk, rv, height=2, width=3, scale=-1.0)
    # per-head table with the wrong number of heads: the library's message names the table
    per_head = irpe.build_rpe(irpe.get_rpe_config(ratio=RATIO, skip=1, shared_head=False), head_dim=3, num_heads=3)[1]
    with pytest.raises(ValueError, match=r"\[rpe\.(attention|term)\].*table"):
        irpe.attention(q, k, v, None, per_head, None, height=2, width=3)
    with pytest.raises(ValueError, match=r"\[rpe.torch\] method = 'prod'"):
        irpe.get_rpe_config(method="prod")
    with pytest.raises(ValueError, match=r"rpe_on = 'x'"):
        irpe.get_rpe_config(rpe_on="x")
    with pytest.raises(ValueError, match=r"\[rpe.term_spec\]"):
        irpe.get_rpe_config(ratio=-1.0)
    with pytest.raises(ValueError, match=r"method = 7"):
        irpe.get_num_buckets(7, 1.9, 3.8, 15.2)


F32, F64 = r"torch\.float32", r"torch\.float64"


def odd_dtype(name, dtype, ref, ref_dtype):
    """pytest.raises of the mixed-dtype TypeError: the odd argument, its dtype, the first argument
    of the dtype most of the call's tensors have, that dtype."""
    return pytest.raises(TypeError, match=rf"\[rpe\.torch\] {name} has dtype {dtype} but {ref} has {ref_dtype}; ")


def test_mixed_dtypes_name_the_argument_that_differs():
    """Each operator family with tensors of two dtypes: the exception names the argument whose
    dtype differs from the others' (the dtype most of them have; a tie: the reference argument's,
    q, x or tables[0]), its dtype and the expected one, whichever argument the call's dtype is read
    from."""
    ops = torch.ops.rpe
    B, H, h, w, D = 1, 2, 2, 3, 4
    L = 1 + h * w
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, L, D, generator=g)
    t = torch.randn(H, D, 26, generator=g)
    none = ([], [], [], "", "", "", "", "", "")
    grid = ([0.0] * 12, h, w, None, None)
    # attention: q alone of another dtype is the one named (k, v agree), not k
    with odd_dtype("q", F64, "k", F32):
        ops.attention_forward(*G(q.double(), q, q, *none, *grid))
    with odd_dtype("q", F64, "k", F32):
        irpe.attention(q.double(), q, q, height=h, width=w)
    with odd_dtype("v", F64, "q", F32):
        ops.attention_forward(*G(q, q, q.double(), *none, *grid))
    # a table of another dtype than q, k, v (a module left in float32 with float64 inputs)
    with odd_dtype(r"tables_k\[0\]", F32, "q", F64):
        ops.attention_forward(*G(q.double(), q.double(), q.double(), [], [t], [], "", "", "product", "contextual", "", "",
                              [0.0] * 4 + [1.0, 2.0, 8.0, 1.0] + [0.0] * 4, h, w, None, None))
    # float64 q, k, v and tables with one float32 table on another slot
    tq, tv = torch.randn(H, D, 26, generator=g), torch.randn(H, 26, D, generator=g)
    with odd_dtype(r"tables_v\[0\]", F32, "q", F64):
        ops.attention_forward(*G(q.double(), q.double(), q.double(), [tq.double()], [t.double()], [tv], "product",
                              "contextual", "product", "contextual", "product", "contextual", [1.0, 2.0, 8.0, 1.0] * 3,
                              h, w, None, None))
    with odd_dtype("attn_mask", F64, "q", F32):
        ops.attention_forward(*G(q, q, q, *none, [0.0] * 12, h, w, None, torch.zeros(L, L, dtype=torch.float64)))
    freqs = torch.randn(2, H, D // 2, generator=g)
    with odd_dtype("rope_freqs", F32, "q", F64):
        ops.attention_forward(*G(q.double(), q.double(), q.double(), *none, *grid, None, "mixed", [], freqs, 1))
    with odd_dtype("grad_out", F64, "q", F32):
        ops.attention_backward(*GB(q, q, q, *none, *grid, None, q.double()))
    with odd_dtype("q", F32, "k", F64):  # q alone float32 in the backward: grad_out and attn side with k, v
        ops.attention_backward(*GB(q, q.double(), q.double(), *none, *grid, None, q.double(),
                               attn=torch.zeros(B, H, L, L, dtype=torch.float64)))
    # terms: the tables' dtype; x of another dtype than a lone table (a tie) is named, but a table
    # alone against x and the other table is the odd one
    with odd_dtype("x", F64, r"tables\[0\]", F32):
        ops.term_forward(q.double(), [t[:1]], "product", "contextual", "k", 1.0, 2.0, 8.0, 1, h, w)
    c = torch.randn(1, D, 5, generator=g)
    with odd_dtype(r"tables\[0\]", F32, "x", F64):
        ops.term_forward(q[:, :, 1:].double(), [c, c.double()], "cross", "contextual", "k", 1.0, 2.0, 8.0, 0, h, w)
    with odd_dtype(r"tables\[1\]", F64, r"tables\[0\]", F32):
        ops.term_forward(q[:, :, 1:], [c, c.double()], "cross", "contextual", "k", 1.0, 2.0, 8.0, 0, h, w)
    with odd_dtype("grad_out", F64, r"tables\[0\]", F32):
        ops.term_backward(q, [t[:1]], torch.zeros(B, H, L, L, dtype=torch.float64), "product", "contextual", "k", 1.0,
                          2.0, 8.0, 1, h, w)
    with odd_dtype(r"tables\[0\]", F32, "x", F64):  # x and grad_out agree
        ops.term_backward(q.double(), [t[:1]], torch.zeros(B, H, L, L, dtype=torch.float64), "product", "contextual",
                          "k", 1.0, 2.0, 8.0, 1, h, w)
    with odd_dtype("x", F32, r"tables\[0\]", F64):  # a tie through the function: the table's dtype is expected
        irpe.term(q, [t[:1].double()], "product", "contextual", "k", 1.0, 2.0, 8.0, 1, h, w)
    # RoPE: x, freqs, grad_y
    with odd_dtype("freqs", F32, "x", F64):
        ops.rope_forward(q.double(), "mixed", [], freqs, 1, h, w)
    with odd_dtype("freqs", F32, "x", F64):
        irpe.RoPEMixed(H, D, skip=1)(q.double(), h, w)  # the module's frequencies
    with odd_dtype("grad_y", F64, "x", F32):
        ops.rope_backward(q, q.double(), "axial", [100.0], None, 1, h, w)
    with odd_dtype("x", F32, "freqs", F64):  # freqs and grad_y agree
        ops.rope_backward(q, q.double(), "mixed", [], freqs.double(), 1, h, w)
    # the table operators (two tensors: the first one's dtype is expected)
    with odd_dtype("grad_table", F64, "raw", F32):
        ops.cpb_table_backward(torch.zeros(15, H), torch.zeros(H, 15, dtype=torch.float64), 2, 3, True)
    with odd_dtype("grad_out", F64, "raw", F32):
        ops.cpb_bias_backward(torch.zeros(15, H), torch.zeros(1, H, 6, 6, dtype=torch.float64), 2, 3, True)
    with odd_dtype("rel_pos_w", F64, "rel_pos_h", F32):
        ops.decomposed_tables(torch.zeros(3, D), torch.zeros(5, D, dtype=torch.float64), h, w, 1, True)
    with odd_dtype(r"grad_tables\[1\]", F32, r"grad_tables\[0\]", F64):
        ops.decomposed_tables_backward(torch.zeros(1, D, 6, dtype=torch.float64), torch.zeros(1, D, 6), 3, 5, h, w, 1,
                                       True)
    m = irpe.DecomposedRelPos(h, w, D)  # the module's parameters, rel_pos_w alone float64
    m.rel_pos_w.data = m.rel_pos_w.data.double()
    with odd_dtype("rel_pos_w", F64, "rel_pos_h", F32):
        irpe.attention(q[:, :, 1:], q[:, :, 1:], q[:, :, 1:], rpe_k=m)


def test_mixed_devices_name_the_argument_that_differs():
    """A tensor not on the CPU given to a CPU operator (here a meta tensor through the CPU kernel,
    or the Python functions' checks): the exception names that argument, its device and cpu."""
    ops = torch.ops.rpe
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    B, H, h, w, D = 1, 2, 2, 3, 4
    L = 1 + h * w
    q = torch.randn(B, H, L, D)
    t = torch.randn(H, D, 26)

    def on(name):
        return pytest.raises(ValueError, match=rf"\[rpe\.torch\] {name} is on device meta; expected cpu")
    with on("v"):
        ops.attention_forward.default.redispatch(cpu, *G(q, q, q.to("meta"), [], [], [], "", "", "", "", "", "",
                                                 [0.0] * 12, h, w, None, None))
    with on(r"tables_k\[0\]"):
        ops.attention_forward.default.redispatch(cpu, *G(q, q, q, [], [t.to("meta")], [], "", "", "product", "contextual",
                                                 "", "", [0.0] * 4 + [1.0, 2.0, 8.0, 1.0] + [0.0] * 4, h, w, None, None))
    cfg = irpe.get_rpe_config(ratio=RATIO, method="product", mode="ctx", shared_head=True, skip=1, rpe_on="k")
    with on(r"tables_k\[0\]"):  # the Python function checks the slots' tables too
        irpe.attention(q, q, q, None, irpe.build_rpe(cfg, head_dim=D, num_heads=H)[1].to("meta"), None, height=h, width=w)
    with on("grad_out"):
        ops.attention_backward.default.redispatch(cpu, *GB(q, q, q, [], [], [], "", "", "", "", "", "", [0.0] * 12, h, w,
                                                  None, None, None, q.to("meta")))
    with on(r"tables\[1\]"):
        c = torch.randn(1, D, 5)
        ops.term_forward.default.redispatch(cpu, q[:, :, 1:], [c, c.to("meta")], "cross", "contextual", "k", 1.0, 2.0,
                                            8.0, 0, h, w)
    with on("x"):
        ops.term_forward.default.redispatch(cpu, q.to("meta"), [t[:1]], "product", "contextual", "k", 1.0, 2.0, 8.0, 1,
                                            h, w)
    with on("freqs"):
        ops.rope_forward.default.redispatch(cpu, q, "mixed", [], torch.randn(2, H, D // 2, device="meta"), 1, h, w)
    with on("grad_y"):
        ops.rope_backward.default.redispatch(cpu, q, q.to("meta"), "axial", [100.0], None, 1, h, w)
    with on("grad_table"):
        ops.cpb_table_backward.default.redispatch(cpu, torch.zeros(15, H), torch.zeros(H, 15, device="meta"), 2, 3, True)
    with on("rel_pos_w"):
        ops.decomposed_tables.default.redispatch(cpu, torch.zeros(3, D), torch.zeros(5, D, device="meta"), h, w, 1, True)


def test_no_silent_wrong_gradients():
    mods, q, k, v, L = attention_setup("product", "contextual", "qkv", True, 1)
    out = irpe.attention(q, k, v, *mods, height=2, width=3)
    # (a double backward raises: test_double_backward_raises_instead_of_dropping_second_order_terms)
    mask = torch.zeros(L, L, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"attn_mask requires grad"):
        irpe.attention(q, k, v, *mods, height=2, width=3, attn_mask=mask)
    masked = irpe.attention(q, k, v, *mods, height=2, width=3, attn_mask=mask.detach())
    assert torch.equal(masked, out)


def test_non_contiguous_inputs_give_the_contiguous_result():
    mods, q, k, v, L = attention_setup("product", "contextual", "qkv", True, 1)
    base = irpe.attention(q, k, v, *mods, height=2, width=3)
    # (B, L, H, D) storage viewed as (B, H, L, D): non-contiguous
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    out = irpe.attention(qt, kt, vt, *mods, height=2, width=3)  # read in place through the strides
    assert torch.allclose(out, base, atol=1e-13, rtol=1e-13)
    # a last stride other than 1 is copied once; the result is the same
    qd = q.detach().transpose(2, 3).contiguous().transpose(2, 3)
    assert qd.stride(-1) != 1
    assert torch.allclose(irpe.attention(qd, kt, vt, *mods, height=2, width=3), base, atol=1e-13, rtol=1e-13)
    x = q.detach().transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(mods[1](x, 2, 3), mods[1](x.contiguous(), 2, 3))
    # gradients too: strided views of one (B, L, 3, H, D) buffer, as a qkv projection gives
    qkv = torch.stack([t.detach().transpose(1, 2) for t in (q, k, v)], 2).requires_grad_()
    qs, ks, vs = qkv.permute(2, 0, 3, 1, 4)
    irpe.attention(qs, ks, vs, *mods, height=2, width=3).sum().backward()
    irpe.attention(q, k, v, *mods, height=2, width=3).sum().backward()
    assert torch.allclose(qkv.grad[:, :, 0].transpose(1, 2), q.grad, atol=1e-12)
    assert torch.allclose(qkv.grad[:, :, 1].transpose(1, 2), k.grad, atol=1e-12)
    assert torch.allclose(qkv.grad[:, :, 2].transpose(1, 2), v.grad, atol=1e-12)
    # and gradcheck through the packed buffer (q, k, v read in place from it)
    packed = qkv.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: irpe.attention(*x.permute(2, 0, 3, 1, 4), *mods, height=2, width=3),
                                    (packed,), eps=1e-6, atol=1e-7, rtol=1e-6)
    xs = qs.detach().clone().requires_grad_()
    xt = xs.detach().transpose(2, 3).contiguous().transpose(2, 3).requires_grad_()
    assert not xt.is_contiguous()
    mods[1](xs, 2, 3).sum().backward()
    mods[1](xt, 2, 3).sum().backward()
    assert torch.allclose(xs.grad, xt.grad, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Drop-in contract
# ---------------------------------------------------------------------------------------------

def test_config_matches_the_reference_fields():
    c = irpe.get_rpe_config()  # reference defaults: ratio 1.9, product, contextual, shared, skip 0, on k
    assert c.rpe_q is None and c.rpe_v is None
    k = c.rpe_k
    assert (k.alpha, k.beta, k.gamma) == (1.9, 3.8, 15.2)
    assert (k.method, k.mode, k.shared_head, k.num_buckets) == (irpe.METHOD.PRODUCT, "contextual", True, 49)
    c = irpe.get_rpe_config(ratio=20, method="euc", mode="ctx", shared_head=False, skip=1, rpe_on="qkv")
    assert c.rpe_v.method == irpe.METHOD.EUCLIDEAN and c.rpe_v.mode == "contextual" and c.rpe_v.num_buckets == 82
    assert irpe.get_rpe_config(method="quant", ratio=33).rpe_k.num_buckets == 133
    assert irpe.build_rpe(None, 8, 2) == (None, None, None)


def test_state_dict_names_and_shapes_are_the_reference():
    """Reference names and shapes (irpe.py: lookup_table_bias (H, K), lookup_table_weight
    (H, D, K) for q/k and (H, K, D) for v; Cross keeps rp_rows / rp_cols), loaded strictly."""
    H, D = 4, 16
    c = irpe.get_rpe_config(ratio=1.9, method="product", mode="ctx", shared_head=True, skip=1, rpe_on="qkv")
    m = torch.nn.ModuleList(irpe.build_rpe(c, D, H))
    expect = {"0.lookup_table_weight": (1, D, 50), "1.lookup_table_weight": (1, D, 50), "2.lookup_table_weight": (1, 50, D)}
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == expect
    c = irpe.get_rpe_config(ratio=1.9, method="euc", mode="bias", shared_head=False, skip=1, rpe_on="qk")
    m = torch.nn.ModuleList([x for x in irpe.build_rpe(c, D, H) if x is not None])
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == {"0.lookup_table_bias": (H, 8),
                                                                     "1.lookup_table_bias": (H, 8)}
    c = irpe.get_rpe_config(ratio=1.9, method="cross", mode="ctx", shared_head=False, skip=0, rpe_on="kv")
    m = torch.nn.ModuleList([x for x in irpe.build_rpe(c, D, H) if x is not None])
    sd = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert sd == {"0.rp_rows.lookup_table_weight": (H, D, 7), "0.rp_cols.lookup_table_weight": (H, D, 7),
                  "1.rp_rows.lookup_table_weight": (H, 7, D), "1.rp_cols.lookup_table_weight": (H, 7, D)}
    src = {k: torch.randn(v) for k, v in sd.items()}
    m.load_state_dict(src, strict=True)
    assert torch.equal(m[0].rp_rows.lookup_table_weight, src["0.rp_rows.lookup_table_weight"])


def test_square_grid_is_inferred():
    c = irpe.get_rpe_config(ratio=1.9, skip=1, rpe_on="k")
    rk = irpe.build_rpe(c, 4, 2)[1]
    torch.nn.init.normal_(rk.lookup_table_weight)
    x = torch.randn(2, 2, 1 + 16, 4)
    assert torch.equal(rk(x), rk(x, 4, 4))
    assert not torch.equal(rk(x, 2, 8), rk(x, 4, 4))


def test_cross_sub_modules_sum_to_the_cross_module():
    c = irpe.get_rpe_config(ratio=RATIO, method="cross", mode="ctx", shared_head=False, skip=1, rpe_on="k")
    rk = irpe.build_rpe(c, 3, 2)[1]
    assert isinstance(rk, irpe.iRPE_Cross) and rk.rp_rows.method == irpe.METHOD.CROSS_ROWS
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in rk.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(2, 2, 1 + 2 * 3, 3, generator=g, requires_grad=True)
    whole = rk(x, 2, 3)
    parts = rk.rp_rows(x, 2, 3) + rk.rp_cols(x, 2, 3)
    assert torch.allclose(whole, parts, atol=1e-6)
    assert not torch.allclose(rk.rp_rows(x, 2, 3), whole, atol=1e-3)  # each part alone is not the whole
    rk.rp_rows(x, 2, 3).sum().backward()
    assert rk.rp_rows.lookup_table_weight.grad.abs().sum() > 0 and rk.rp_cols.lookup_table_weight.grad is None


@pytest.mark.parametrize("mode", ["bias", "contextual"])
def test_query_target_operator_is_the_transposed_key_term(mode):
    """torch.ops.rpe.term_forward with target q is the library's query term: the key term of the
    transposed pair, as the attention adds rpe_q(k·s)ᵀ; its backward matches autograd of that."""
    ts = tables("product", mode, "q", 2, 3, 1, seed=11)
    x = torch.randn(2, 2, 7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    xin = x if mode == "contextual" else None
    args = ("product", mode, RATIO, 2 * RATIO, 8 * RATIO, 1, 2, 3)
    spec = lambda target: (args[0], args[1], target) + args[2:]  # noqa: E731
    out_q = torch.ops.rpe.term_forward(xin, ts, *spec("q"))
    out_k = irpe.term(xin, ts, "product", mode, "k", RATIO, 2 * RATIO, 8 * RATIO, 1, 2, 3)
    assert torch.allclose(out_q, out_k.transpose(2, 3), atol=1e-12)
    grad = torch.randn(out_q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    grads = torch.ops.rpe.term_backward(xin, ts, grad, *spec("q"))
    (out_k.transpose(2, 3) * grad).sum().backward()
    if mode == "contextual":
        assert torch.allclose(grads[0], x.grad, atol=1e-12)
    assert torch.allclose(grads[1], ts[0].grad, atol=1e-12)


@pytest.mark.parametrize("rpe_on", ["k", "qkv"])
def test_attention_backward_with_and_without_saved_probabilities(rpe_on):
    mods, q, k, v, L = attention_setup("product", "contextual", rpe_on, False, 1)
    params = [p for m in mods if m is not None for p in m.parameters()]
    kpm = torch.zeros(2, L, dtype=torch.bool)
    kpm[1, -2:] = True
    grads = []
    for save in (True, False):
        for t in (q, k, v, *params):
            t.grad = None
        irpe.attention(q, k, v, *mods, height=2, width=3, key_padding_mask=kpm, save_attn=save).pow(2).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v, *params)])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-13, rtol=1e-12)

    def f(q, k, v, *ps):
        return irpe.attention(q, k, v, *mods, height=2, width=3, key_padding_mask=kpm, save_attn=False)

    assert torch.autograd.gradcheck(f, (q, k, v, *params), eps=1e-6, atol=1e-7, rtol=1e-6, fast_mode=True)


def test_double_backward_raises_instead_of_dropping_second_order_terms():
    mods, q, k, v, L = attention_setup("product", "contextual", "k", True, 1)
    out = irpe.attention(q, k, v, *mods, height=2, width=3)
    with pytest.raises(RuntimeError, match=r"\[rpe.torch\] the rpe_torch operators are differentiable once"):
        torch.autograd.grad((out ** 2).sum(), q, create_graph=True)  # a gradient penalty's first step
    x = q.detach().clone().requires_grad_()
    y = mods[1](x, 2, 3)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    # a first-order backward is unaffected
    (g,) = torch.autograd.grad(irpe.attention(q, k, v, *mods, height=2, width=3).sum(), q)
    assert torch.isfinite(g).all()
