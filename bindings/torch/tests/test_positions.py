"""rpe_torch with the iRPE terms at per-token positions, packed sequences and valid key lengths
(issue 26, item 4; docs/positions.md): ``rpe_torch.attention(rpe_positions=, rpe_key_positions=,
packed_lengths=, packed_grids=, packed_positions=, key_lengths=)``, ``rpe_torch.term(positions=,
key_positions=)`` and the iRPE modules' ``forward(positions=)``.

Checked against the grid path: positions equal to the grid give the grid's results bit for bit;
positions equal to a permuted grid give the permuted grid's outputs and gradients (the same sums,
in another order: float64 rounding); a packed batch of 4 images equals each image run alone
(outputs, gradients of q, k, v and of every table summed over the images); key_lengths equal the
same key_padding_mask. Errors name the argument; torch.compile(fullgraph=True) of a block with
packed lengths has no graph break.
"""
import re

import pytest
import torch

import rpe_torch
from rpe_torch._registrations import attention_op_args as G  # the attention operators' grouped arguments
from conftest import random_irpe_modules

F64 = torch.float64
H, D = 2, 4


def grid_positions(h, w):
    """(h*w, 2) (row, col) of a row-major h x w grid, int64."""
    return torch.stack([torch.arange(h * w) // w, torch.arange(h * w) % w], 1)


def modules(rpe_on="qkv", mode="contextual", method=rpe_torch.METHOD.PRODUCT, skip=1, shared_head=False, seed=0):
    """(rpe_q, rpe_k, rpe_v) float64 modules with random tables (ratio 1.9: K = 50 + the skip bucket)."""
    return random_irpe_modules(D, H, rpe_on, mode, shared_head, seed, method=method, skip=skip)


def params_of(ms):
    return [p for m in ms if m is not None for p in m.parameters()]


def qkv(B, L, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=F64, requires_grad=True) for _ in range(3)]


def run(ms, q, k, v, seed=7, **kw):
    """(out, [grad_q, grad_k, grad_v, grad of each table]) of sum(out * r), r random."""
    for t in [q, k, v, *params_of(ms)]:
        t.grad = None
    out = rpe_torch.attention(q, k, v, *ms, **kw)
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    (out * r).sum().backward()
    return out.detach(), [t.grad.clone() for t in [q, k, v, *params_of(ms)]]


CASES = {  # name: build_rpe's (rpe_on, mode, shared_head)
    "k_contextual": ("k", "contextual", True),
    "qkv_contextual": ("qkv", "contextual", False),
    "k_bias": ("k", "bias", False),
}


# ---------------------------------------------------------------------------------------------
# Per-token positions
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("save_attn", [None, False])
def test_positions_equal_to_the_grid_give_the_grid_exactly(case, save_attn):
    rpe_on, mode, shared = CASES[case]
    ms = modules(rpe_on, mode, shared_head=shared)
    h, w = 3, 4
    q, k, v = qkv(2, 1 + h * w)
    out, grads = run(ms, q, k, v, height=h, width=w, save_attn=save_attn)
    out_p, grads_p = run(ms, q, k, v, rpe_positions=grid_positions(h, w), save_attn=save_attn)
    assert torch.equal(out, out_p)
    for a, b in zip(grads, grads_p):
        assert torch.equal(a, b)
    # int32, keys given too, every position moved by the same vector: the same ids, the same results
    shifted = (grid_positions(h, w) + torch.tensor([5, -3])).to(torch.int32)
    out_k, grads_k = run(ms, q, k, v, rpe_positions=shifted, rpe_key_positions=shifted, save_attn=save_attn)
    assert torch.equal(out, out_k)
    for a, b in zip(grads, grads_k):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", sorted(CASES))
def test_positions_of_a_permuted_grid_give_the_permuted_grid(case):
    """Tokens in another order at their grid positions: the outputs and gradients of the grid
    run on the tokens in grid order, permuted back (the same sums in another key order)."""
    rpe_on, mode, shared = CASES[case]
    ms = modules(rpe_on, mode, shared_head=shared, seed=3)
    h, w, skip = 3, 4, 1
    perm = torch.randperm(h * w, generator=torch.Generator().manual_seed(5))
    order = torch.cat([torch.arange(skip), skip + perm])  # token i of the permuted sequence = grid token order[i]
    q, k, v = qkv(2, skip + h * w, seed=4)
    out, grads = run(ms, q, k, v, height=h, width=w)
    qp, kp, vp = [t.detach()[:, :, order].clone().requires_grad_() for t in (q, k, v)]
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    for t in params_of(ms):
        t.grad = None
    out_p = rpe_torch.attention(qp, kp, vp, *ms, rpe_positions=grid_positions(h, w)[perm])
    (out_p * r[:, :, order]).sum().backward()
    torch.testing.assert_close(out_p.detach(), out[:, :, order], rtol=0, atol=1e-13)
    for a, b in zip(grads[:3], (qp.grad, kp.grad, vp.grad)):
        torch.testing.assert_close(b, a[:, :, order], rtol=0, atol=1e-12)
    for a, t in zip(grads[3:], params_of(ms)):
        torch.testing.assert_close(t.grad, a, rtol=1e-12, atol=1e-12)


def test_key_positions_other_than_the_queries():
    """Keys at their own positions: the contextual k term reads id(pos_i - kpos_j); checked against
    the term operator at the same positions plus the attention written out in torch."""
    (rk,) = [m for m in modules("k", "contextual", seed=8) if m is not None]
    h, w = 2, 3
    q, k, v = qkv(1, 1 + h * w, seed=9)
    pos = grid_positions(h, w)
    kpos = pos[torch.tensor([5, 3, 1, 0, 2, 4])] * 2 - 1
    out = rpe_torch.attention(q, k, v, None, rk, None, rpe_positions=pos, rpe_key_positions=kpos)
    qs = q * D ** -0.5
    logits = qs @ k.transpose(-1, -2) + rk(qs, positions=pos, key_positions=kpos)
    ref = torch.softmax(logits, -1) @ v
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)


@pytest.mark.parametrize("case", ["k_contextual", "k_bias", "v_contextual"])
def test_term_at_permuted_positions_is_the_permuted_grid_term(case):
    mode = "bias" if case == "k_bias" else "contextual"
    rpe_on = case[0]
    ms = modules(rpe_on, mode, seed=11)
    (m,) = [x for x in ms if x is not None]
    h, w = 3, 3
    L = 1 + h * w
    perm = torch.randperm(h * w, generator=torch.Generator().manual_seed(12))
    order = torch.cat([torch.tensor([0]), 1 + perm])
    g = torch.Generator().manual_seed(13)
    x = (torch.randn(2, H, L, D, generator=g, dtype=F64) if rpe_on == "k"
         else torch.softmax(torch.randn(2, H, L, L, generator=g, dtype=F64), -1)).requires_grad_()
    out = m(x, h, w)
    xp = (x.detach()[:, :, order] if rpe_on == "k" else x.detach()[:, :, order][:, :, :, order]).requires_grad_()
    out_p = m(xp, positions=grid_positions(h, w)[perm])
    expected = out[:, :, order] if rpe_on == "v" else out[:, :, order][:, :, :, order]
    if rpe_on == "k":  # each entry the same sum: bit for bit
        assert torch.equal(out_p, expected)
    torch.testing.assert_close(out_p, expected, rtol=0, atol=1e-13)
    # gradients through rpe_torch.term's autograd (positions not differentiated)
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(14), dtype=F64)
    rp = r[:, :, order] if rpe_on == "v" else r[:, :, order][:, :, :, order]
    if mode == "bias":  # no input
        r, rp = r[:1], rp[:1]
        (gt,) = torch.autograd.grad((out * r).sum(), [*m.parameters()])
        (gtp,) = torch.autograd.grad((out_p * rp).sum(), [*m.parameters()])
    else:
        (gx, gt) = torch.autograd.grad((out * r).sum(), [x, *m.parameters()])
        (gxp, gtp) = torch.autograd.grad((out_p * rp).sum(), [xp, *m.parameters()])
        gx_perm = gx[:, :, order] if rpe_on == "k" else gx[:, :, order][:, :, :, order]
        torch.testing.assert_close(gxp, gx_perm, rtol=0, atol=1e-12)
    torch.testing.assert_close(gtp, gt, rtol=1e-12, atol=1e-12)
    # rpe_torch.term directly, keys at the queries' positions given explicitly: the same
    cfg = m.rpe_config
    direct = rpe_torch.term(xp if mode != "bias" else None, [m._table()], "product", mode, rpe_on, cfg.alpha, cfg.beta,
                            cfg.gamma, 1, 0, 0, positions=grid_positions(h, w)[perm],
                            key_positions=grid_positions(h, w)[perm])
    assert torch.equal(direct, out_p)


# ---------------------------------------------------------------------------------------------
# Packed sequences
# ---------------------------------------------------------------------------------------------

IMAGES = [(3, 4), (2, 2), (4, 3), (1, 5)]


def packed_vs_alone(ms, skip, with_positions, B=2):
    lengths = [skip + h * w for h, w in IMAGES]
    L = sum(lengths)
    q, k, v = qkv(B, L, seed=21)
    perms = [torch.randperm(h * w, generator=torch.Generator().manual_seed(22 + i)) for i, (h, w) in enumerate(IMAGES)]
    kw = {"packed_lengths": torch.tensor(lengths, dtype=torch.int32)}
    if with_positions:
        kw["packed_positions"] = torch.cat([grid_positions(h, w)[p] for (h, w), p in zip(IMAGES, perms)])
    else:
        kw["packed_grids"] = torch.tensor(IMAGES)
    out, grads = run(ms, q, k, v, **kw)
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    outs, gq, gk, gv = [], [], [], []
    gt = [torch.zeros_like(t) for t in params_of(ms)]
    start = 0
    for (h, w), n, p in zip(IMAGES, lengths, perms):
        qi, ki, vi = [t.detach()[:, :, start:start + n].clone().requires_grad_() for t in (q, k, v)]
        for t in params_of(ms):
            t.grad = None
        extra = {"rpe_positions": grid_positions(h, w)[p]} if with_positions else {"height": h, "width": w}
        oi = rpe_torch.attention(qi, ki, vi, *ms, **extra)
        (oi * r[:, :, start:start + n]).sum().backward()
        outs.append(oi.detach())
        gq.append(qi.grad)
        gk.append(ki.grad)
        gv.append(vi.grad)
        for acc, t in zip(gt, params_of(ms)):
            acc += t.grad
        start += n
    torch.testing.assert_close(out, torch.cat(outs, 2), rtol=0, atol=1e-13)
    for got, want in zip(grads, [torch.cat(gq, 2), torch.cat(gk, 2), torch.cat(gv, 2), *gt]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("with_positions", [False, True], ids=["grids", "positions"])
def test_packed_batch_equals_each_image_alone(case, with_positions):
    rpe_on, mode, shared = CASES[case]
    packed_vs_alone(modules(rpe_on, mode, shared_head=shared, seed=20), 1, with_positions)


def test_packed_without_skip_tokens_and_cross():
    packed_vs_alone(modules("qk", "contextual", method=rpe_torch.METHOD.CROSS, skip=0, seed=24), 0, False, B=1)


def test_packed_without_terms_is_block_diagonal_attention():
    lengths = [3, 5, 2]
    q, k, v = qkv(1, 10, seed=25)
    out = rpe_torch.attention(q, k, v, packed_lengths=torch.tensor(lengths))
    start, ref = 0, []
    for n in lengths:
        sl = slice(start, start + n)
        ref.append(torch.softmax(q[:, :, sl] @ k[:, :, sl].transpose(-1, -2) * D ** -0.5, -1) @ v[:, :, sl])
        start += n
    torch.testing.assert_close(out, torch.cat(ref, 2), rtol=0, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# Key lengths
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("save_attn", [None, False])
def test_key_lengths_equal_the_key_padding_mask(case, save_attn):
    rpe_on, mode, shared = CASES[case]
    ms = modules(rpe_on, mode, shared_head=shared, seed=30)
    h, w = 3, 3
    L = 1 + h * w
    lengths = [L, 6, 1]
    q, k, v = qkv(3, L, seed=31)
    mask = torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None]
    out_m, grads_m = run(ms, q, k, v, height=h, width=w, key_padding_mask=mask, save_attn=save_attn)
    out_l, grads_l = run(ms, q, k, v, height=h, width=w, key_lengths=torch.tensor(lengths), save_attn=save_attn)
    torch.testing.assert_close(out_l, out_m, rtol=0, atol=1e-13)
    for a, b in zip(grads_l, grads_m):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.all(grads_l[1][1, :, 6:] == 0) and torch.all(grads_l[2][2, :, 1:] == 0)  # padded keys: exactly zero


def test_key_lengths_zero_gives_zeros():
    ms = modules("k", "contextual", seed=32)
    q, k, v = qkv(2, 5, seed=33)
    out = rpe_torch.attention(q, k, v, *ms, height=2, width=2, key_lengths=torch.tensor([5, 0], dtype=torch.int32))
    assert torch.all(out[1] == 0)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def test_errors_name_the_argument():
    ms = modules("k", "contextual", seed=40)
    h, w = 2, 3
    q, k, v = qkv(2, 1 + h * w, seed=41)
    pos = grid_positions(h, w)

    def call(**kw):
        return rpe_torch.attention(q, k, v, *ms, **kw)

    with pytest.raises(TypeError, match=r"rpe_positions has dtype torch.float32; expected an integer tensor"):
        call(rpe_positions=pos.float())
    with pytest.raises(TypeError, match=r"rpe_positions is a list; expected a torch.Tensor"):
        call(rpe_positions=pos.tolist())
    with pytest.raises(ValueError, match=r"rpe_positions has shape \(6, 4\); expected \(N, 2\)"):
        call(rpe_positions=torch.cat([pos, pos], 1))
    with pytest.raises(ValueError, match=r"rpe_positions is on device meta; expected cpu"):
        call(rpe_positions=pos.to("meta"))
    # q itself on such a device is named first (its own check; "or cuda" follows with the CUDA kernels)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] q is on device meta; expected cpu"):
        rpe_torch.attention(*(t.detach().to("meta") for t in (q, k, v)), rpe_positions=pos)
    with pytest.raises(ValueError, match=r"rpe_key_positions is given without rpe_positions"):
        call(rpe_key_positions=pos)
    with pytest.raises(ValueError, match=r"rpe_positions of 5 tokens for L = 7 gives skip = 2, but the term was "
                                         r"configured with skip = 1"):
        call(rpe_positions=pos[:5])
    # keys and queries of different counts: the argument's own name (the library's field is key_positions)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rpe_key_positions has shape \(5, 2\); expected \(6 = L - skip = "
                                         r"7 - 1 of rpe_k, 2\)"):
        call(rpe_positions=pos, rpe_key_positions=pos[:5])
    with pytest.raises(TypeError, match=r"key_lengths has dtype torch.bool"):
        call(height=h, width=w, key_lengths=torch.tensor([True, False]))
    with pytest.raises(ValueError, match=r"key_lengths has shape \(2, 1\); expected a 1-D tensor"):
        call(height=h, width=w, key_lengths=torch.tensor([[7], [3]]))
    with pytest.raises(ValueError, match=r"key_lengths has shape \(3,\); expected \(2,\)"):
        call(height=h, width=w, key_lengths=torch.tensor([7, 3, 1]))
    with pytest.raises(ValueError, match=r"key_lengths\[1\] = 8; expected 0 <= length <= L = 7"):
        call(height=h, width=w, key_lengths=torch.tensor([7, 8]))
    with pytest.raises(ValueError, match=r"packed_grids is given without packed_lengths"):
        call(packed_grids=torch.tensor([[2, 3]]))
    with pytest.raises(ValueError, match=r"rope is given with packed_lengths"):
        call(packed_lengths=torch.tensor([7]), packed_grids=torch.tensor([[2, 3]]), rope=rpe_torch.RoPEAxial(D, H))
    with pytest.raises(ValueError, match=r"key_lengths is given with packed_lengths"):
        call(packed_lengths=torch.tensor([7]), packed_grids=torch.tensor([[2, 3]]), key_lengths=torch.tensor([7, 7]))
    with pytest.raises(ValueError, match=r"packed.lengths sum to 8; expected L = 7 of q"):
        call(packed_lengths=torch.tensor([4, 4]), packed_grids=torch.tensor([[1, 3], [1, 3]]))
    with pytest.raises(ValueError, match=r"packed.grids\[1\] = \(1, 2\) gives skip \+ height\*width = 3 tokens of rpe_k; "
                                         r"expected packed.lengths\[1\] = 4"):
        call(packed_lengths=torch.tensor([3, 4]), packed_grids=torch.tensor([[1, 2], [1, 2]]))
    with pytest.raises(ValueError, match=r"rpe_k is attached with packed but neither packed.grids nor packed.positions"):
        call(packed_lengths=torch.tensor([7]))
    with pytest.raises(ValueError, match=r"packed_positions has shape \(4, 2\); expected \(L - M\*skip, 2 or 3\) rows "
                                         r"for L = 7 and M = 2 images"):
        call(packed_lengths=torch.tensor([3, 4]), packed_positions=pos[:4])



NOT_INT32_64 = [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64]


@pytest.mark.parametrize("dtype", NOT_INT32_64, ids=str)
def test_index_arguments_are_int32_or_int64(dtype):
    """Every iRPE index argument takes int32 / int64 only (docs/torch.md): another integer dtype,
    unsigned ones included, is a TypeError naming the argument and its dtype, before any value is
    read (unsigned ones used to fail inside torch's min, not naming the argument; int8, int16 and
    uint8 were taken). RoPE positions (integer or float) are another check."""
    ms = modules("k", "contextual", seed=43)
    h, w = 2, 3
    q, k, v = qkv(2, 1 + h * w, seed=44)
    pos = grid_positions(h, w)

    def call(**kw):
        return rpe_torch.attention(q, k, v, *ms, **kw)

    lengths, grids = torch.tensor([7]), torch.tensor([[2, 3]])
    cases = [  # (argument, its description in the message, the call with that argument in `dtype`)
        ("rpe_positions", "per-token iRPE positions", lambda: call(rpe_positions=pos.to(dtype))),
        ("rpe_key_positions", "per-token iRPE key positions",
         lambda: call(rpe_positions=pos, rpe_key_positions=pos.to(dtype))),
        ("packed_lengths", "tokens per image", lambda: call(packed_lengths=lengths.to(dtype), packed_grids=grids)),
        ("packed_grids", r"per-image grids \(height, width\)",
         lambda: call(packed_lengths=lengths, packed_grids=grids.to(dtype))),
        ("packed_positions", "per-token positions of the packed images",
         lambda: call(packed_lengths=lengths, packed_positions=pos.to(dtype))),
        ("key_lengths", "valid key lengths", lambda: call(height=h, width=w, key_lengths=torch.tensor([7, 3], dtype=dtype))),
        ("positions", "per-token positions", lambda: ms[1](q, positions=pos.to(dtype))),
        ("key_positions", "per-token key positions", lambda: ms[1](q, positions=pos, key_positions=pos.to(dtype))),
        ("positions", "per-token positions",
         lambda: rpe_torch.term(q, [ms[1].lookup_table_weight], "product", "contextual", "k", 1.9, 3.8, 15.2, 1, 2, 3,
                                positions=pos.to(dtype))),
    ]
    dt = re.escape(str(dtype))
    for name, what, f in cases:
        with pytest.raises(TypeError, match=rf"^\[rpe\.torch\] {name} has dtype {dt}; "
                                            rf"expected an integer tensor \(int32 or int64\) of {what}$"):
            f()
    # the operators themselves check the same (called directly)
    table = ms[1].lookup_table_weight.detach()
    with pytest.raises(TypeError, match=r"^\[rpe\.torch\] positions has dtype \S+; expected an integer tensor "
                                        r"\(int32 or int64\) of per-token iRPE positions$"):
        torch.ops.rpe.term_forward(q.detach(), [table], "product", "contextual", "k", 1.9, 3.8, 15.2, 1, h, w,
                                   pos.to(dtype))
    # the same values in int32 / int64 are taken
    want = call(height=h, width=w)
    for t in (torch.int32, torch.int64):
        assert torch.equal(call(rpe_positions=pos.to(t)), want)
        assert torch.equal(call(packed_lengths=lengths.to(t), packed_grids=grids.to(t)), want)


def test_rope_positions_keep_integer_and_float_dtypes():
    """The RoPE positions (``positions`` / ``key_positions`` of the attention with a rope) are not
    the iRPE index arguments: float32 / float64 and other integer dtypes stay accepted."""
    h, w = 2, 3
    q, k, v = qkv(1, 1 + h * w, seed=45)
    rope = rpe_torch.RoPEAxial(skip=1)
    pos = grid_positions(h, w)
    want = rpe_torch.attention(q, k, v, rope=rope, height=h, width=w)
    for t in (torch.float32, torch.float64, torch.int16, torch.int32):
        got = rpe_torch.attention(q, k, v, rope=rope, positions=pos.to(t), key_positions=pos.to(t))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)



# ---------------------------------------------------------------------------------------------
# Integer RoPE positions beyond 2^24 (float32, as the library reads them, would round them)
# ---------------------------------------------------------------------------------------------

EXACT = 2 ** 24  # float32 holds every integer up to 2^24; 2^24 + 1 rounds to 2^24, 2^24 + 3 to 2^24 + 4


def beyond_2_24(name, row, col, value, read_as):
    """The operators' ValueError for integer RoPE positions name[row, col] = value > 2^24 in
    magnitude, which float32 would read as read_as (written out by hand)."""
    return (rf"^\[rpe\.torch\] {name}\[{row}, {col}\] = {value}; expected integer positions with \|value\| <= "
            rf"2\^24 = 16777216 \(positions are read in float32, exact for integers up to 2\^24: this one would be "
            rf"read as {read_as}\)$")


def with_value(pos, row, col, value):
    """int64 positions pos with pos[row, col] = value."""
    pos = pos.clone()
    pos[row, col] = value
    return pos


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint32, torch.uint64])
def test_rope_positions_beyond_2_24_refused_by_rope(dtype):
    """rpe_torch.rope (the rope_forward operator) refuses integer positions of magnitude > 2^24
    in every integer dtype that can hold one, naming the element, its value and what float32
    would read; 2^24 itself is exact and taken (the rotation at float32 2^24 bit for bit)."""
    x = torch.randn(1, H, 6, D, generator=torch.Generator().manual_seed(60), dtype=F64)
    rope = rpe_torch.RoPEAxial(theta=100.0)
    pos = grid_positions(2, 3)
    with pytest.raises(ValueError, match=beyond_2_24("positions", 4, 1, EXACT + 1, 16777216)):
        rpe_torch.rope(x, rope, positions=with_value(pos, 4, 1, EXACT + 1).to(dtype))
    with pytest.raises(ValueError, match=beyond_2_24("positions", 2, 0, EXACT + 3, 16777220)):
        rpe_torch.rope(x, rope, positions=with_value(pos, 2, 0, EXACT + 3).to(dtype))
    if dtype in (torch.int32, torch.int64):
        with pytest.raises(ValueError, match=beyond_2_24("positions", 0, 1, -EXACT - 1, -16777216)):
            rpe_torch.rope(x, rope, positions=with_value(pos, 0, 1, -EXACT - 1).to(dtype))
        at = with_value(with_value(pos, 4, 1, EXACT), 0, 0, -EXACT)
    else:
        at = with_value(pos, 4, 1, EXACT)
    if dtype == torch.uint64:  # beyond int64: still refused with its own value
        with pytest.raises(ValueError, match=beyond_2_24("positions", 1, 1, 2 ** 64 - 1, 18446744073709551616)):
            rpe_torch.rope(x, rope, positions=with_value(pos, 1, 1, -1).to(dtype))
    want = rpe_torch.rope(x, rope, positions=at.to(torch.float32))
    assert torch.equal(rpe_torch.rope(x, rope, positions=at.to(dtype)), want)
    # floating positions are the caller's own values (not checked): 2^24 + 1 in float64 is taken
    # and read as float32 2^24, the rounding an integer 2^24 + 1 would have had silently
    big, exact = with_value(pos, 4, 1, EXACT + 1).to(F64), with_value(pos, 4, 1, EXACT).to(F64)
    assert torch.equal(rpe_torch.rope(x, rope, positions=big), rpe_torch.rope(x, rope, positions=exact))
    assert not torch.equal(want, rpe_torch.rope(x, rope, positions=pos.to(dtype)))  # the position matters


def test_rope_positions_beyond_2_24_refused_by_the_modules():
    """The RoPE modules' forward (here Qwen-VL's M-RoPE, (t, h, w) position ids, and V-JEPA 2's
    (frame, row, col)) refuse integer position ids beyond 2^24 and take 2^24."""
    x = torch.randn(1, H, 4, 12, generator=torch.Generator().manual_seed(61), dtype=F64)
    ids = torch.tensor([[0, 0, 0], [1, 0, 1], [1, 1, 0], [1, 1, 1]])
    mrope = rpe_torch.RoPEMRoPE(sections=(2, 2, 2))
    with pytest.raises(ValueError, match=beyond_2_24("positions", 1, 2, -EXACT - 1, -16777216)):
        mrope(x, positions=with_value(ids, 1, 2, -EXACT - 1))
    at = with_value(ids, 3, 0, EXACT)
    assert torch.equal(mrope(x, positions=at), mrope(x, positions=at.to(torch.float32)))
    vjepa2 = rpe_torch.RoPEVJEPA2(theta=100.0, grid_depth=2, grid_size=2)
    with pytest.raises(ValueError, match=beyond_2_24("positions", 3, 0, EXACT + 1, 16777216)):
        vjepa2(x, positions=with_value(ids, 3, 0, EXACT + 1).to(torch.int32))
    assert torch.equal(vjepa2(x, positions=at.to(torch.int32)), vjepa2(x, positions=at.to(torch.float32)))


@pytest.mark.parametrize("save_attn", [None, True])
def test_rope_positions_beyond_2_24_refused_by_the_attention(save_attn):
    """rpe_torch.attention's positions / key_positions (the operators' rope_positions /
    rope_key_positions, forward and forward_attn) refuse integer positions beyond 2^24 by the
    operators' names, and take 2^24 (the result of float32 positions of the same values)."""
    h, w = 2, 3
    q, k, v = qkv(1, 1 + h * w, seed=62)
    rope = rpe_torch.RoPEAxial(skip=1)
    pos = grid_positions(h, w)

    def call(**kw):
        return rpe_torch.attention(q, k, v, rope=rope, save_attn=save_attn, **kw)

    with pytest.raises(ValueError, match=beyond_2_24("rope_positions", 5, 0, EXACT + 1, 16777216)):
        call(positions=with_value(pos, 5, 0, EXACT + 1))
    with pytest.raises(ValueError, match=beyond_2_24("rope_key_positions", 0, 1, -EXACT - 1, -16777216)):
        call(positions=pos, key_positions=with_value(pos, 0, 1, -EXACT - 1).to(torch.int32))
    at, kat = with_value(pos, 5, 0, EXACT), with_value(pos, 0, 1, -EXACT)
    got = call(positions=at, key_positions=kat.to(torch.int32))
    torch.testing.assert_close(got, call(positions=at.to(torch.float32), key_positions=kat.to(torch.float32)),
                               rtol=0, atol=0)

def test_key_positions_without_positions_before_the_grid():
    """An iRPE module's forward (iRPE and iRPE_Cross) given key_positions but no positions names
    the missing argument, whether or not L is skip + a square (it used to blame L = 13 first)."""
    for method in (rpe_torch.METHOD.PRODUCT, rpe_torch.METHOD.CROSS):
        rk = modules("k", "contextual", method=method, seed=46)[1]
        x = torch.randn(1, H, 13, D, dtype=F64)
        pos = grid_positions(3, 4)
        for kw in ({}, {"height": 3, "width": 4}):
            with pytest.raises(ValueError, match=r"^\[rpe\.torch\] key_positions is given without positions; expected "
                                                 r"positions too \(the queries'\)$"):
                rk(x, key_positions=pos[:5], **kw)


@pytest.mark.parametrize("cuda_kernels", [True, False])
def test_index_device_message(monkeypatch, cuda_kernels):
    """An index tensor on a device other than the CPU and the other tensors' (here meta): the
    message says CUDA takes them on q's (x's) device, and when the library lacks the CUDA kernels,
    that it was built without them (the text used to say CUDA refuses them, no longer true)."""
    monkeypatch.setattr(rpe_torch, "has_cuda_kernels", lambda: cuda_kernels)
    ms = modules("k", "contextual", seed=47)
    h, w = 2, 3
    q, k, v = qkv(2, 1 + h * w, seed=48)
    meta = grid_positions(h, w).to("meta")

    def expected(name, where, other, what):
        tail = (f"expected cpu, or {other} when that is cuda \\({what}\\)" if cuda_kernels else
                f"expected cpu \\({what}; {other} when that is cuda needs the CUDA kernels, which this operator "
                "library was built without: CMake option RPE_TORCH_CUDA\\)")
        return rf"^\[rpe\.torch\] {name} is on device {where}; " + tail + "$"

    with pytest.raises(ValueError, match=expected("rpe_positions", "meta", "q's device", "per-token iRPE positions")):
        rpe_torch.attention(q, k, v, *ms, rpe_positions=meta)
    with pytest.raises(ValueError, match=expected("key_lengths", "meta", "q's device", "valid key lengths")):
        rpe_torch.attention(q, k, v, *ms, height=h, width=w, key_lengths=torch.tensor([7, 3], device="meta"))
    with pytest.raises(ValueError, match=expected("packed_lengths", "meta", "q's device", "tokens per image")):
        rpe_torch.attention(q, k, v, *ms, packed_lengths=torch.tensor([7], device="meta"),
                            packed_grids=torch.tensor([[2, 3]]))
    with pytest.raises(ValueError, match=expected("positions", "meta", "x's device", "per-token positions")):
        ms[1](q, positions=meta)
    bias = rpe_torch.get_rpe_config(ratio=1.9, method=rpe_torch.METHOD.PRODUCT, mode="bias", shared_head=False,
                                    skip=1, rpe_on="k")
    table = rpe_torch.build_rpe(bias, head_dim=D, num_heads=H)[1].lookup_table_bias
    with pytest.raises(ValueError, match=expected("positions", "meta", "the tables' device", "per-token positions")):
        rpe_torch.term(None, [table], "product", "bias", "k", 1.9, 3.8, 15.2, 1, 2, 3, positions=meta)

def test_operator_errors_name_the_argument():
    """The operators themselves (the Python checks bypassed): dtype, device, int32 range."""
    ops = torch.ops.rpe
    q, k, v = [t.detach() for t in qkv(1, 7, seed=42)]
    t = torch.randn(1, D, 50, dtype=F64)  # K = 49 + the skip bucket
    pos = grid_positions(2, 3)

    def op(**kw):
        idx = [kw.get(n) for n in ("rpe_positions", "rpe_key_positions", "packed_lengths", "packed_grids",
                                   "packed_positions", "key_lengths")]
        return ops.attention_forward(*G(q, k, v, [], [t], [], "", "", "product", "contextual", "", "",
                                     [0.0] * 4 + [1.9, 3.8, 15.2, 1.0] + [0.0] * 4, 2, 3, None, None, None, "", [],
                                     None, 0, "pairs", None, None, 0, *idx))

    with pytest.raises(TypeError, match=r"\[rpe.torch\] rpe_positions has dtype torch\.float32; expected an integer tensor"):
        op(rpe_positions=pos.float())
    with pytest.raises(ValueError, match=r"\[rpe.torch\] key_lengths holds values in \[4294967296, 4294967296\]; expected 32-bit"):
        op(key_lengths=torch.tensor([4294967296]))
    with pytest.raises(ValueError, match=r"packed_positions is given without packed_lengths"):
        op(packed_positions=pos)
    with pytest.raises(ValueError, match=r"\[rpe.torch\] key_positions is given without positions"):
        ops.term_forward(q, [t], "product", "contextual", "k", 1.9, 3.8, 15.2, 1, 2, 3, None, pos)
    with pytest.raises(ValueError, match=r"\[rpe.term\] x has shape \(1, 2, 7, 4\); expected .* with L = 6 = skip 1 \+ 5 positions"):
        ops.term_forward(q, [t], "product", "contextual", "k", 1.9, 3.8, 15.2, 1, 2, 3, pos[:5])


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------

class PackedBlock(torch.nn.Module):
    """qkv projection, attention with iRPE on k over a packed sequence, output projection."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(H * D, 3 * H * D, dtype=F64)
        self.proj = torch.nn.Linear(H * D, H * D, dtype=F64)
        _, self.rpe_k, _ = modules("k", "contextual", seed=50)

    def forward(self, x, lengths, grids=None, positions=None):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        o = rpe_torch.attention(q, k, v, None, self.rpe_k, None, packed_lengths=lengths, packed_grids=grids,
                                packed_positions=positions)
        return self.proj(o.transpose(1, 2).reshape(B, L, H * D))


@pytest.mark.parametrize("with_positions", [False, True], ids=["grids", "positions"])
def test_compile_packed_block_fullgraph(with_positions):
    torch.manual_seed(51)
    block = PackedBlock()
    lengths = torch.tensor([1 + 6, 1 + 4, 1 + 9])
    grids = torch.tensor([[2, 3], [2, 2], [3, 3]])
    positions = torch.cat([grid_positions(2, 3), grid_positions(2, 2), grid_positions(3, 3)]).flip(0)
    kw = {"positions": positions} if with_positions else {"grids": grids}
    x = torch.randn(2, 22, H * D, dtype=F64)
    ref = block(x, lengths, **kw)
    (gref,) = torch.autograd.grad(ref.sum(), [block.rpe_k.lookup_table_weight])
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x, lengths, **kw)
    (gout,) = torch.autograd.grad(out.sum(), [block.rpe_k.lookup_table_weight])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(gout, gref, rtol=1e-12, atol=1e-12)


def test_vit_term_modules_take_positions_and_packing():
    """A ViT term module (RelPosBias, Swin bias) and a TermSlot at positions equal to the grid, and
    packed with a copy of themselves: the grid's results."""
    h, w = 2, 3
    rb = rpe_torch.RelPosBias(window_size=(h, w), num_heads=H, kind="swin", skip=0).double()
    slot = rpe_torch.TermSlot("swin", [torch.randn(H, 15, generator=torch.Generator().manual_seed(60), dtype=F64)],
                              (h, w))
    q, k, v = [t.detach() for t in qkv(1, h * w, seed=61)]
    with torch.no_grad():
        for p in rb.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(62), dtype=F64))
    for m in (rb, slot):
        out = rpe_torch.attention(q, k, v, rpe_k=m)
        assert torch.equal(rpe_torch.attention(q, k, v, rpe_k=m, rpe_positions=grid_positions(h, w)), out)
        two = [torch.cat([t, t], 2) for t in (q, k, v)]
        packed = rpe_torch.attention(*two, rpe_k=m, packed_lengths=torch.tensor([6, 6]),
                                     packed_grids=torch.tensor([[h, w], [h, w]]))
        torch.testing.assert_close(packed, torch.cat([out, out], 2), rtol=0, atol=1e-13)
