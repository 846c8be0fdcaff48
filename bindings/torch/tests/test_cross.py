"""Cross-attention through rpe_torch.attention (CPU): keys and values of another length than the
queries (L_k != L). A small SAM2-like memory attention: queries on a 2 x 3 grid, keys on that grid
repeated once per memory frame (rope key_positions = the repeated grid), RoPE-Axial with SAM2's
theta; against the rotations by the RoPE module followed by a plain softmax attention, with
torch.autograd.gradcheck in float64 (q, k, v), masks of the keys' length, the saved probabilities
(B, H, L, L_k), torch.library.opcheck of the three attention operators, and the refusals (an iRPE
term on a grid with L_k != L, v of another length than k). SAM2's whole memory attention in one call: the
keys' object-pointer tokens unrotated (the module's suffix) while the queries have none
(rope_query_suffix=0, rotary_embedding::query_suffix), against a RoPE-Axial written with torch ops
and scaled_dot_product_attention (forward, gradients, gradcheck, opcheck, torch.compile fullgraph),
its refusals, and the CUDA operator's refusal (host side, without a device). The messages name
what the caller gave: rope_query_suffix's length errors (the grid's count, the suffix apart from
skip), the iRPE terms' rpe_positions / rpe_key_positions by those names (apart from the RoPE's
positions / key_positions), and rpe_positions without an attached iRPE term is refused."""
import math

import pytest
import torch

import rpe_torch as irpe
from conftest import attention_backward_op_args as GB  # noqa: E402  (the attention operators' grouped arguments)
from rpe_torch._registrations import attention_op_args as G  # noqa: E402

ops = torch.ops.rpe
F64 = torch.float64
B, H, D, h, w, R = 2, 2, 8, 2, 3, 2  # R memory frames: L = 6 queries, L_k = 12 keys


def rnd(*shape, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g, dtype=F64).requires_grad_(grad)


def key_positions():
    """(R·h·w, 2) (row, col): the query grid once per memory frame (rope::repeated_grid_positions)."""
    grid = torch.stack([torch.arange(h * w) // w, torch.arange(h * w) % w], 1)
    return grid.repeat(R, 1).to(torch.float32)


def reference(q, k, v, rope, kp, attn_mask=None, key_padding_mask=None):
    """The rotations by the module, then softmax((q·s)·kᵀ + masks)·v in float64."""
    qr, kr = rope(q, h, w), rope(k, positions=kp)
    logits = (qr * D ** -0.5) @ kr.transpose(-1, -2)
    if attn_mask is not None:
        logits = logits + attn_mask
    if key_padding_mask is not None:
        logits = logits.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    return torch.softmax(logits, -1) @ v


@pytest.mark.parametrize("save_attn", [False, True])
def test_sam2_like_cross_attention_matches_the_rotations_then_softmax(save_attn):
    rope, kp = irpe.RoPEAxial(theta=10000.0), key_positions()
    q, k, v = rnd(B, H, h * w, D, seed=1), rnd(B, H, R * h * w, D, seed=2), rnd(B, H, R * h * w, D, seed=3)
    mask = rnd(h * w, R * h * w, grad=False, seed=4)
    kpm = torch.zeros(B, R * h * w, dtype=torch.bool)
    kpm[1, -3:] = True
    out = irpe.attention(q, k, v, rope=rope, height=h, width=w, key_positions=kp, attn_mask=mask, key_padding_mask=kpm,
                         save_attn=save_attn)
    assert out.shape == (B, H, h * w, D)
    ref = reference(q, k, v, rope, kp, mask, kpm)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    go = rnd(B, H, h * w, D, grad=False, seed=5)
    got = torch.autograd.grad(out, (q, k, v), go)
    want = torch.autograd.grad(ref, (q, k, v), go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)


def test_sam2_like_cross_attention_gradcheck():
    rope, kp = irpe.RoPEAxial(theta=10000.0), key_positions()
    q, k, v = rnd(1, H, h * w, D, seed=6), rnd(1, H, R * h * w, D, seed=7), rnd(1, H, R * h * w, D, seed=8)
    for save_attn in (False, True):
        assert torch.autograd.gradcheck(
            lambda q, k, v: irpe.attention(q, k, v, rope=rope, height=h, width=w, key_positions=kp, save_attn=save_attn),
            (q, k, v))


def cross_args():
    """attention_forward's arguments: no terms, RoPE-Axial (theta 10000) with the queries on the grid
    and the keys at the repeated grid, an (L, L_k) mask and a (B, L_k) key padding mask."""
    L, Lk = h * w, R * h * w
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[0, 1] = True
    return (rnd(B, H, L, D, seed=11), rnd(B, H, Lk, D, seed=12), rnd(B, H, Lk, D, seed=13), [], [], [], "", "", "", "",
            "", "", [0.0] * 12, h, w, kpm, rnd(L, Lk, grad=False, seed=14), None, "axial", [10000.0], None, 0, "pairs",
            None, key_positions(), 0)


@pytest.mark.parametrize("name", ["attention_forward", "attention_forward_attn"])
def test_opcheck_cross(name):
    op = getattr(ops, name)
    args = cross_args()
    out = op(*G(*args))
    if name == "attention_forward_attn":
        assert out[1].shape == (B, H, h * w, R * h * w)  # (B, H, L, L_k)
    torch.library.opcheck(op, G(*args))


def test_opcheck_cross_backward():
    args = cross_args()
    out, attn = ops.attention_forward_attn(*G(*args))
    q, k, v = (t.detach() for t in args[:3])
    go = rnd(*out.shape, grad=False, seed=15)
    back = (q, k, v, *args[3:17], None, go, "axial", [10000.0], None, 0, attn.detach(), "pairs", None, key_positions(), 0)
    grads = ops.attention_backward(*GB(*back))
    assert [tuple(g.shape) for g in grads[:3]] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
    torch.library.opcheck(ops.attention_backward, GB(*back))


def test_cross_attention_refusals_name_the_argument():
    q, k, v = rnd(B, H, 6, D, seed=21), rnd(B, H, 9, D, seed=22), rnd(B, H, 9, D, seed=23)
    with pytest.raises(ValueError, match=r"\[rpe\.attention\] v has shape \(2, 2, 8, 8\); expected \(2, 2, 9, 8\), "
                                         r"the shape of k"):
        irpe.attention(q, k, v[:, :, :8], height=2, width=3)
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(2, 6\); expected \(2, 9\)"):
        irpe.attention(q, k, v, height=2, width=3, key_padding_mask=torch.zeros(B, 6, dtype=torch.bool))
    term = irpe.RelPosBias((2, 3), H).double()
    # a grid describes one token set: with L_k != L the terms need rpe_positions and rpe_key_positions
    # (test_irpe_cross.py)
    with pytest.raises(ValueError, match=r"rpe_k is attached with keys of another length than the queries "
                                         r"\(L = 6, L_k = 9\)"):
        irpe.attention(q, k, v, rpe_k=term, height=2, width=3)


# ---------------------------------------------------------------------------------------------
# SAM2's memory attention in one call: rope_query_suffix (rotary_embedding::query_suffix)
# ---------------------------------------------------------------------------------------------

P = 3  # object-pointer tokens: the keys' unrotated suffix; L = 6 queries, L_k = 12 + 3 keys
THETA = 10000.0


def axial_by_hand(x, pos, suffix=0):
    """rope-vit's RoPE-Axial written with torch ops: pair p < D/4 of each token turns by col·f_p,
    pair D/4 + p by row·f_p, f_p = 1/θ^(4p/D), channels (2p, 2p+1) as the complex x_2p + i·x_2p+1;
    pos (N, 2) (row, col) of the first N tokens, the last ``suffix`` unrotated. The angles in
    float32 as rope-vit's compute_axial_cis (and rpe::rope::axial) make them, cos / sin and the
    rotation in x's float64."""
    d = x.shape[-1]
    f = 1.0 / (torch.tensor(THETA) ** (torch.arange(0, d, 4, dtype=torch.float32)[: d // 4] / d))
    pos = pos.to(torch.float32)
    angles = torch.cat([pos[:, 1:2] * f, pos[:, 0:1] * f], 1).to(F64)  # (N, D/2): cols first, then rows
    n = pos.shape[0]
    xr = x[..., :n, :].reshape(*x.shape[:-2], n, d // 2, 2)
    c, s = torch.cos(angles), torch.sin(angles)
    y = torch.stack([xr[..., 0] * c - xr[..., 1] * s, xr[..., 0] * s + xr[..., 1] * c], -1).reshape(*x.shape[:-2], n, d)
    return torch.cat([y, x[..., n:n + suffix, :]], -2)


def grid_positions():
    return torch.stack([torch.arange(h * w) // w, torch.arange(h * w) % w], 1)


def sam2_reference(q, k, v, attn_mask=None):
    """The queries rotated on the grid, the memory keys at the grid once per frame with the P
    pointers unrotated, then torch's scaled_dot_product_attention (float64)."""
    qr = axial_by_hand(q, grid_positions())
    kr = axial_by_hand(k, grid_positions().repeat(R, 1), suffix=P)
    return torch.nn.functional.scaled_dot_product_attention(qr, kr, v, attn_mask=attn_mask)


def sam2_inputs(b=B, seed=40):
    L, Lk = h * w, R * h * w + P
    return rnd(b, H, L, D, seed=seed), rnd(b, H, Lk, D, seed=seed + 1), rnd(b, H, Lk, D, seed=seed + 2)


def test_axial_by_hand_is_the_rope_module():
    """The reference rotation above is RoPEAxial's (with and without the pointer suffix)."""
    q, k, _ = sam2_inputs()
    torch.testing.assert_close(axial_by_hand(q, grid_positions()), irpe.RoPEAxial(theta=THETA)(q, h, w),
                               atol=1e-13, rtol=1e-13)
    kp = grid_positions().repeat(R, 1)
    torch.testing.assert_close(axial_by_hand(k, kp, suffix=P),
                               irpe.RoPEAxial(theta=THETA, suffix=P)(k, positions=kp), atol=1e-13, rtol=1e-13)


@pytest.mark.parametrize("save_attn", [False, True])
def test_sam2_memory_attention_with_query_suffix_matches_torch(save_attn):
    """rope_query_suffix=0: the queries are the grid alone, the keys R memory frames and P
    unrotated pointers (the module's suffix); forward and gradients of q, k, v against the
    rotations written with torch ops and scaled_dot_product_attention, with an (L, L_k) mask."""
    q, k, v = sam2_inputs()
    mask = rnd(h * w, R * h * w + P, grad=False, seed=44)
    rope = irpe.RoPEAxial(theta=THETA, suffix=P)
    out = irpe.attention(q, k, v, rope=rope, height=h, width=w, key_positions=grid_positions().repeat(R, 1),
                         rope_query_suffix=0, attn_mask=mask, save_attn=save_attn)
    ref = sam2_reference(q, k, v, mask)
    assert out.shape == (B, H, h * w, D)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    go = rnd(B, H, h * w, D, grad=False, seed=45)
    got = torch.autograd.grad(out, (q, k, v), go)
    for a, b in zip(got, torch.autograd.grad(ref, (q, k, v), go)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)
    assert got[1][:, :, -P:].abs().sum() > 0  # the pointer keys (unrotated) are attended


def test_sam2_memory_attention_with_query_suffix_gradcheck():
    q, k, v = sam2_inputs(b=1, seed=50)
    rope, kp = irpe.RoPEAxial(theta=THETA, suffix=P), grid_positions().repeat(R, 1)
    for save_attn in (False, True):
        assert torch.autograd.gradcheck(
            lambda q, k, v: irpe.attention(q, k, v, rope=rope, height=h, width=w, key_positions=kp, rope_query_suffix=0,
                                           save_attn=save_attn), (q, k, v))


def test_query_suffix_equal_to_suffix_is_the_default_and_a_square_grid_uses_it():
    """rope_query_suffix = the module's suffix (or -1) is the default; without height and width
    the queries' square grid is L − skip − rope_query_suffix."""
    rope = irpe.RoPEAxial(theta=THETA, suffix=1)
    q, k, v = rnd(B, H, 1 + 4 + 1, D, seed=60), rnd(B, H, 1 + 4 + 1, D, seed=61), rnd(B, H, 1 + 4 + 1, D, seed=62)
    base = irpe.attention(q, k, v, rope=irpe.RoPEAxial(theta=THETA, skip=1, suffix=1))
    for qs in (1, -1):
        torch.testing.assert_close(irpe.attention(q, k, v, rope=irpe.RoPEAxial(theta=THETA, skip=1, suffix=1),
                                                  rope_query_suffix=qs), base, atol=0, rtol=0)
    # queries: a 2 x 2 grid with no suffix; keys: that grid twice and one pointer
    kp = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]]).repeat(2, 1)
    qg, kg, vg = q[:, :, :4], rnd(B, H, 9, D, seed=63), rnd(B, H, 9, D, seed=64)
    out = irpe.attention(qg, kg, vg, rope=rope, key_positions=kp, rope_query_suffix=0)
    qr = axial_by_hand(qg, kp[:4])
    kr = axial_by_hand(kg, kp, suffix=1)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(qr, kr, vg), atol=1e-12, rtol=1e-12)


def sam2_args():
    """attention_forward's arguments for SAM2's memory attention: RoPE-Axial, keys at the repeated
    grid, P pointer keys (rope_suffix), rope_query_suffix 0 (the last argument), an (L, L_k) mask."""
    q, k, v = sam2_inputs(seed=70)
    return (q, k, v, [], [], [], "", "", "", "", "", "", [0.0] * 12, h, w, None, rnd(h * w, R * h * w + P, grad=False,
                                                                                  seed=73),
            None, "axial", [THETA], None, 0, "pairs", None, grid_positions().repeat(R, 1), P, None, None, None, None,
            None, None, 0)


@pytest.mark.parametrize("name", ["attention_forward", "attention_forward_attn"])
def test_opcheck_query_suffix(name):
    op = getattr(ops, name)
    args = sam2_args()
    out = op(*G(*args))
    ref = sam2_reference(*args[:3], args[16])
    torch.testing.assert_close(out[0] if isinstance(out, list) else out, ref, atol=1e-12, rtol=1e-12)
    torch.library.opcheck(op, G(*args))


def test_opcheck_query_suffix_backward():
    args = sam2_args()
    out, attn = ops.attention_forward_attn(*G(*args))
    q, k, v = (t.detach() for t in args[:3])
    go = rnd(*out.shape, grad=False, seed=75)
    for saved in (None, attn.detach()):
        back = (q, k, v, *args[3:17], None, go, "axial", [THETA], None, 0, saved, "pairs", None, args[24], P, None, None,
                None, None, None, None, 0)
        grads = ops.attention_backward(*GB(*back))
        want = torch.autograd.grad(sam2_reference(*args[:3], args[16]), args[:3], go)
        for a, b in zip(grads[:3], want):
            torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)
        torch.library.opcheck(ops.attention_backward, GB(*back))


def test_query_suffix_compiles_fullgraph():
    """torch.compile(fullgraph=True) of the SAM2 memory attention with rope_query_suffix: no graph
    break, the eager result and gradients (aot_eager: the fake kernels and autograd formulas)."""
    rope, kp = irpe.RoPEAxial(theta=THETA, suffix=P), grid_positions().repeat(R, 1)

    def f(q, k, v):
        return irpe.attention(q, k, v, rope=rope, height=h, width=w, key_positions=kp, rope_query_suffix=0)

    q, k, v = sam2_inputs(seed=80)
    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
    go = rnd(*eager.shape, grad=False, seed=81)
    for a, b in zip(torch.autograd.grad(compiled, (q, k, v), go), torch.autograd.grad(eager, (q, k, v), go)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_query_suffix_refusals_name_it():
    q, k, v = sam2_inputs(seed=90)
    rope, kp = irpe.RoPEAxial(theta=THETA, suffix=P), grid_positions().repeat(R, 1)
    for bad in (-2, True, 1.0, "0"):
        with pytest.raises(ValueError, match=rf"\[rpe\.torch\] rope_query_suffix = {bad!r}; expected an int >= 0, "
                                             r"or None / -1 for the rope's suffix"):
            irpe.attention(q, k, v, rope=rope, height=h, width=w, key_positions=kp, rope_query_suffix=bad)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope_query_suffix = 0 is given without rope"):
        irpe.attention(q, k[:, :, :h * w], v[:, :, :h * w], height=h, width=w, rope_query_suffix=0)
    # the library's length check names the queries' suffix when it is set apart from the keys'
    with pytest.raises(ValueError, match=r"\[rpe\.attention\] L = 6; expected rope skip \+ height\*width \+ "
                                         r"query_suffix = 0 \+ 2\*3 \+ 1"):
        irpe.attention(q, k, v, rope=rope, height=h, width=w, key_positions=kp, rope_query_suffix=1)
    with pytest.raises(ValueError, match=r"\[rpe\.attention\] L = 6; expected rope skip \+ height\*width \+ "
                                         r"suffix = 0 \+ 2\*3 \+ 3"):  # without it: the keys' suffix for q too
        irpe.attention(q, k, v, rope=rope, height=h, width=w, key_positions=kp)
    # the operators' own checks (torch.ops.rpe called directly)
    args = sam2_args()
    for name in ("attention_forward", "attention_forward_attn"):
        with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope_query_suffix = -2; expected >= 0, or -1 for "
                                             r"rope_suffix \(the keys'\)"):
            getattr(ops, name)(*G(*args[:-1], -2))
        with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope_query_suffix = 1073741824; expected >= 0"):
            getattr(ops, name)(*G(*args[:-1], 1 << 30))
    no_rope = (*args[:18], "", [], None, 0, "pairs", None, None, 0, *args[26:32])
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope_query_suffix = 0 without a RoPE \(rope_form = ''\); "
                                         r"expected -1"):
        ops.attention_forward(*G(*no_rope, 0))
    back = (*args[:17], None, args[0].detach(), "axial", [THETA], None, 0, None, "pairs", None, args[24], P)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope_query_suffix = -3; expected >= 0"):
        ops.attention_backward(*GB(*back, None, None, None, None, None, None, -3))


@pytest.mark.skipif(not irpe.has_cuda_kernels(), reason="the operator library was built without its CUDA kernels")
def test_cuda_operators_take_query_suffix_and_check_it_as_the_cpu():
    """The CUDA operators run SAM2's memory attention (rope_query_suffix apart from rope_suffix, keys
    of another length) as the CPU ones: called here through the dispatcher's CUDA key with CPU
    tensors (no device needed), a good rope_query_suffix passes the argument checks and reaches the
    device check, a bad one gets the CPU's message first (test_cuda.py runs the call on a GPU)."""
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    args = sam2_args()
    for qs in (0, P, -1):
        with pytest.raises(ValueError, match=r"\[rpe\.torch\] no argument is a CUDA tensor"):
            ops.attention_forward.default.redispatch(cuda, *G(*args[:-1], qs))
    back = (*args[:17], None, args[0].detach(), "axial", [THETA], None, 0, None, "pairs", None, args[24], P,
            None, None, None, None, None, None, 0)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] no argument is a CUDA tensor"):
        ops.attention_backward.default.redispatch(cuda, *GB(*back))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope_query_suffix = -2; expected >= 0"):
        ops.attention_forward.default.redispatch(cuda, *G(*args[:-1], -2))


# ---------------------------------------------------------------------------------------------
# The messages name what the caller gave: rope_query_suffix's lengths, the iRPE terms' positions
# by their Python names (rpe_positions / rpe_key_positions, apart from the RoPE's positions /
# key_positions), and rpe_positions without a term refused rather than ignored
# ---------------------------------------------------------------------------------------------

def test_query_suffix_length_errors_state_what_was_given():
    q, k, v = sam2_inputs(seed=100)
    rope, kp = irpe.RoPEAxial(theta=THETA, suffix=P), grid_positions().repeat(R, 1)
    # queries on the given grid: the grid's count, no word of positions (none were given for q)
    for qs in (6, 7):
        with pytest.raises(ValueError, match=rf"^\[rpe\.attention\] L = 6; expected rope skip \+ height\*width \+ "
                                             rf"query_suffix = 0 \+ 2\*3 \+ {qs}$"):
            irpe.attention(q, k, v, rope=rope, height=h, width=w, key_positions=kp, rope_query_suffix=qs)
    # a square grid inferred (height, width None): the suffix is named as given, not called skip
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] L = 6 is not skip \+ a square \+ rope_query_suffix \(skip = 0, "
                                         r"rope_query_suffix = 6: 0 tokens left for the square grid; the rope's suffix = 3 "
                                         r"counts the keys only\); expected L = 0 \+ side\*side \+ 6, or pass height and "
                                         r"width$"):
        irpe.attention(q, k, v, rope=rope, key_positions=kp, rope_query_suffix=6)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] L = 6 is not skip \+ a square \+ rope_query_suffix \(skip = 1, "
                                         r"rope_query_suffix = 0: 5 tokens left for the square grid; the rope's suffix = 3 "
                                         r"counts the keys only\); expected L = 1 \+ side\*side \+ 0, or pass height and "
                                         r"width$"):
        irpe.attention(q, k, v, rope=irpe.RoPEAxial(theta=THETA, skip=1, suffix=P), key_positions=kp,
                       rope_query_suffix=0)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] L = 6 is not skip \+ a square \+ suffix \(skip = 0, suffix = 3: "
                                         r"3 tokens left for the square grid\); expected L = 0 \+ side\*side \+ 3, or pass "
                                         r"height and width$"):
        irpe.attention(q, k, v, rope=rope, key_positions=kp)
    # no suffix at all: the message of a plain square grid, unchanged
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] L = 7 is not skip \+ a square \(skip = 0\); pass height and "
                                         r"width$"):
        irpe.attention(*(rnd(B, H, 7, D, seed=101 + i) for i in range(3)), rope=irpe.RoPEAxial(theta=THETA))
    # V-JEPA 2's clip likewise names rope_query_suffix
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] L = 6 is not skip \+ frames\*side\*side \+ rope_query_suffix "
                                         r"\(skip = 0, frames = 1, rope_query_suffix = 1; the "
                                         r"rope's suffix = 3 counts the keys only\); pass height and width \(or "
                                         r"grid_size\)$"):
        irpe.attention(q, k, v, rope=irpe.RoPEVJEPA2(suffix=P), key_positions=torch.zeros(R * h * w, 3),
                       rope_query_suffix=1)
    # the keys at key_positions with none left to rotate: key_positions named (they were given)
    with pytest.raises(ValueError, match=r"^\[rpe\.attention\] L_k = 15; expected rope skip \+ suffix = 12 \+ 3 below L_k "
                                         r"\(key_positions need rotated tokens\)$"):
        irpe.attention(q, k, v, rope=irpe.RoPEAxial(theta=THETA, skip=12, suffix=P), height=h, width=w,
                       key_positions=kp, rope_query_suffix=0)


# the iRPE terms at positions with keys of another count (test_irpe_cross.py has the values)
QP = torch.tensor([[0, 0], [1, 2], [-1, 1], [2, -1]])
KP = torch.tensor([[0, 1], [3, 0], [-2, -2], [1, 1], [0, 0], [3, 0]])


def irpe_k(d=4):
    """A product contextual iRPE on keys, per-head tables, one skip token (random tables)."""
    cfg = irpe.get_rpe_config(ratio=1.9, method=irpe.METHOD.PRODUCT, mode="contextual", shared_head=False, skip=1,
                              rpe_on="k")
    _, m, _ = irpe.build_rpe(cfg, head_dim=d, num_heads=H)
    with torch.no_grad():
        m.lookup_table_weight.copy_(rnd(*m.lookup_table_weight.shape, grad=False, seed=110))
    return m.double()


def test_irpe_position_errors_name_the_python_arguments():
    """rpe_positions / rpe_key_positions of the wrong count, axes or values, or missing with
    L_k != L: the messages name the arguments the caller passed (the library's own name its
    fields positions / key_positions, which are the RoPE's arguments of rpe_torch.attention)."""
    d, m = 4, irpe_k()
    q, k, v = rnd(B, H, 5, d, seed=111), rnd(B, H, 7, d, seed=112), rnd(B, H, 7, d, seed=113)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] rpe_k is attached with keys of another length than the queries "
                                         r"\(L = 5, L_k = 7\) and no rpe_positions; expected rpe_positions \(the queries'\) "
                                         r"and rpe_key_positions \(the keys'\): a grid \(height, width\) describes one token "
                                         r"set$"):
        irpe.attention(q, k, v, rpe_k=m, height=2, width=2)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] rpe_key_positions is not given with keys of another length than "
                                         r"the queries \(L = 5, L_k = 7\) and rpe_k attached; expected the keys' positions "
                                         r"\(L_k - skip = 7 - 1 of them\)$"):
        irpe.attention(q, k, v, rpe_k=m, rpe_positions=QP)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] rpe_key_positions has shape \(4, 2\); expected \(6 = L_k - skip = "
                                         r"7 - 1 of rpe_k, 2\) integer coordinates \(row, col\) for a 2D mapping$"):
        irpe.attention(q, k, v, rpe_k=m, rpe_positions=QP, rpe_key_positions=QP)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] rpe_key_positions has shape \(6, 3\); expected \(6 = L_k - skip = "
                                         r"7 - 1 of rpe_k, 2\) integer coordinates \(row, col\) for a 2D mapping$"):
        irpe.attention(q, k, v, rpe_k=m, rpe_positions=QP, rpe_key_positions=torch.zeros(6, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] rpe_positions\[1, 0\] = 2097152; expected \|value\| <= "
                                         r"rpe::max_position = 1048576$"):
        irpe.attention(q, k, v, rpe_k=m, rpe_positions=QP * (1 << 21), rpe_key_positions=KP)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] rpe_key_positions\[0, 1\] = -2097152; expected \|value\| <= "
                                         r"rpe::max_position = 1048576$"):
        irpe.attention(q, k, v, rpe_k=m, rpe_positions=QP, rpe_key_positions=-KP * (1 << 21))
    # self-attention (L_k = L): the keys' count is L - skip
    q7, k7, v7 = rnd(B, H, 7, d, seed=114), rnd(B, H, 7, d, seed=115), rnd(B, H, 7, d, seed=116)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] rpe_key_positions has shape \(5, 2\); expected \(6 = L - skip = "
                                         r"7 - 1 of rpe_k, 2\) integer coordinates \(row, col\) for a 2D mapping$"):
        irpe.attention(q7, k7, v7, rpe_k=m, rpe_positions=KP, rpe_key_positions=KP[:5])
    # beside a RoPE at positions: its errors say "rope positions", the terms' "rpe_positions"
    rope = irpe.RoPEAxial(theta=THETA, skip=1)
    with pytest.raises(ValueError, match=r"^\[rpe\.attention\] rope positions has shape \(5, 2\); expected \(6, 2\)$"):
        irpe.attention(q7, k7, v7, rpe_k=m, rope=rope, positions=KP[:5], rpe_positions=KP)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] rpe_key_positions has shape \(4, 2\); expected \(6 = L - skip"):
        irpe.attention(q7, k7, v7, rpe_k=m, rope=rope, positions=KP, rpe_positions=KP, rpe_key_positions=QP)
    # the operators themselves (the Python checks bypassed), forward and backward
    t = m.lookup_table_weight.detach()
    args = (q.detach(), k.detach(), v.detach(), [], [t], [], "", "", "product", "contextual", "", "",
            [0.0] * 4 + [1.9, 3.8, 15.2, 1.0] + [0.0] * 4, 1, 1, None, None, None)
    tail = ("", [], None, 0, "pairs", None, None, 0, QP, QP, None, None, None, None, -1)
    msg = r"^\[rpe\.torch\] rpe_key_positions has shape \(4, 2\); expected \(6 = L_k - skip = 7 - 1 of rpe_k, 2\)"
    for name in ("attention_forward", "attention_forward_attn"):
        with pytest.raises(ValueError, match=msg):
            getattr(ops, name)(*G(*args, *tail))
    back = (*args, q.detach(), "", [], None, 0, None, "pairs", None, None, 0, QP, QP, None, None, None, None, -1)
    with pytest.raises(ValueError, match=msg):
        ops.attention_backward(*GB(*back))


def test_irpe_positions_without_a_term_are_refused():
    """rpe_positions (and rpe_key_positions) with no iRPE term attached: nothing would read them,
    so they are refused by name instead of being silently ignored (of any count)."""
    q, k, v = rnd(B, H, 6, D, seed=120), rnd(B, H, 6, D, seed=121), rnd(B, H, 6, D, seed=122)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] rpe_positions is given but no iRPE term \(rpe_q, rpe_k, rpe_v\) "
                                         r"is attached; expected none \(they are the iRPE terms' per-token positions; the "
                                         r"RoPE's are positions / key_positions\)$"):
        irpe.attention(q, k, v, height=2, width=3, rpe_positions=QP)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] rpe_positions and rpe_key_positions are given but no iRPE term "
                                         r"\(rpe_q, rpe_k, rpe_v\) is attached"):
        irpe.attention(q, k, v, rope=irpe.RoPEAxial(theta=THETA), height=2, width=3, rpe_positions=QP,
                       rpe_key_positions=KP[:2])
    # an iRPE module without a mode has no term either
    none_mode = irpe.iRPE(head_dim=D, num_heads=H, mode=None, method=irpe.METHOD.PRODUCT, num_buckets=50)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] rpe_positions is given but no iRPE term"):
        irpe.attention(q, k, v, rpe_k=none_mode, height=2, width=3, rpe_positions=QP)
    # the operators
    args = (q.detach(), k.detach(), v.detach(), [], [], [], "", "", "", "", "", "", [0.0] * 12, 2, 3, None, None, None,
            "", [], None, 0, "pairs", None, None, 0)
    msg = (r"^\[rpe\.torch\] rpe_positions is given but no iRPE term \(rpe_q, rpe_k, rpe_v\) is attached \(method_q, "
           r"method_k, method_v are ''\); expected none \(nothing reads them: they are the iRPE terms' positions, the "
           r"RoPE's are rope_positions / rope_key_positions\)$")
    for name in ("attention_forward", "attention_forward_attn"):
        with pytest.raises(ValueError, match=msg):
            getattr(ops, name)(*G(*args, QP, None, None, None, None, None, -1))
    back = (*args[:18], q.detach(), "", [], None, 0, None, "pairs", None, None, 0, QP, KP, None, None, None, None, -1)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] rpe_positions and rpe_key_positions are given but no iRPE "
                                         r"term"):
        ops.attention_backward(*GB(*back))
    # with packed sequences the packed images' positions are packed_positions
    t = irpe_k(D).lookup_table_weight.detach()
    packed = (q.detach(), k.detach(), v.detach(), [], [t], [], "", "", "product", "contextual", "", "",
              [0.0] * 4 + [1.9, 3.8, 15.2, 1.0] + [0.0] * 4, 0, 0, None, None, None, "", [], None, 0, "pairs", None,
              None, 0)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] rpe_positions is given with packed_lengths; expected "
                                         r"packed_positions \(every image's positions, image after image\) instead$"):
        ops.attention_forward(*G(*packed, QP, None, torch.tensor([6]), torch.tensor([[1, 5]]), None, None, -1))
