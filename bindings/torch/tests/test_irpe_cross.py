"""iRPE terms with keys of another count than the queries (cross-attention, L_k != L) through
rpe_torch on the CPU (docs/positions.md, "Queries and keys of different counts").

The term operator (``torch.ops.rpe.term_forward``, which ``rpe_torch.term`` and the iRPE modules
call) with ``positions=P, key_positions=K`` of N != N_k: its (…, L, L_k) output equals
the query rows and key columns of the same term over one token set holding both (skip tokens,
the queries, then the keys), every mode and target; gradcheck in float64.
``rpe_torch.attention(q, k, v, rpe_q, rpe_k, rpe_v, rpe_positions=P, rpe_key_positions=K)`` with
k, v of length L_k: against the attention written out in torch with the iRPE modules at those
positions (rpe_q as the reference's, on k·s with the roles of the positions swapped, transposed),
forward and gradients; gradcheck; torch.library.opcheck of the term and attention operators
(their fake kernels give the (…, L, L_k) shapes); and the refusals (a grid with L_k != L, missing
rpe_key_positions, the wrong count).
"""
import pytest
import torch

import rpe_torch
from conftest import random_irpe_modules
from rpe_torch._registrations import attention_op_args

ops = torch.ops.rpe
F64 = torch.float64
B, H, D, SKIP = 2, 2, 3, 1
# hand-made irregular positions (row, col): 4 queries, 6 keys (a shared position, a repeat)
QP = torch.tensor([[0, 0], [1, 2], [-1, 1], [2, -1]])
KP = torch.tensor([[0, 1], [3, 0], [-2, -2], [1, 1], [0, 0], [3, 0]])
L, LK = SKIP + len(QP), SKIP + len(KP)
UNION = torch.cat([QP, KP])  # skip tokens, then the queries, then the keys
ROWS = list(range(SKIP)) + [SKIP + i for i in range(len(QP))]
COLS = list(range(SKIP)) + [SKIP + len(QP) + j for j in range(len(KP))]
LU = SKIP + len(UNION)
K = 50  # product, ratio 1.9: 49 buckets + the skip bucket
RATIO = (1.9, 3.8, 15.2)


def rnd(*shape, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g, dtype=F64).requires_grad_(grad)


def term(x, tables, mode, target, positions, key_positions=None):
    """The term operator (differentiable; its target "q" is the library's query target, id of the
    key's offset from the query, where rpe_torch.term's "q" is the module's untransposed output)."""
    return ops.term_forward(x, tables, "product", mode, target, *RATIO, SKIP, 0, 0, positions, key_positions)


CASES = [("bias", "k"), ("bias", "q"), ("contextual", "k"), ("contextual", "q"), ("contextual", "v")]


@pytest.mark.parametrize("mode,target", CASES)
@pytest.mark.parametrize("heads", [1, H])
def test_term_is_the_block_of_the_term_over_both_token_sets(mode, target, heads):
    if mode == "bias":
        table, x, xu = rnd(heads, K, seed=1), None, None
    elif target == "v":
        table = rnd(heads, K, D, seed=2)
        x = rnd(B, H, L, LK, seed=3)
        xu = torch.zeros(B, H, LU, LU, dtype=F64)  # the queries' rows and the keys' columns; else 0
        for a, i in enumerate(ROWS):
            xu[:, :, i, COLS] = x[:, :, a]
    else:
        table = rnd(heads, D, K, seed=4)
        # x = q·s (key target: L rows) or k·s (query target: L_k rows); the other set's rows are 0
        x = rnd(B, H, L if target == "k" else LK, D, seed=5)
        xu = torch.zeros(B, H, LU, D, dtype=F64)
        xu[:, :, ROWS if target == "k" else COLS] = x
    out = term(x, [table], mode, target, QP, KP)
    want_shape = (B, H, L, D) if target == "v" else ((1, heads, L, LK) if mode == "bias" else (B, H, L, LK))
    assert tuple(out.shape) == want_shape
    union = term(xu, [table], mode, target, UNION)
    block = union[:, :, ROWS] if target == "v" else union[:, :, ROWS][:, :, :, COLS]
    torch.testing.assert_close(out, block, rtol=0, atol=1e-14)


@pytest.mark.parametrize("mode", ["bias", "contextual"])
def test_rpe_torch_term_query_target_keeps_the_modules_orientation(mode):
    """rpe_torch.term with target "q" and key positions apart: the reference module's orientation,
    x = k·s (rows the keys), out (…, L_k, L) = the keys' rows and the queries' columns of the
    module's output over both token sets (and the transpose of the operator's query target)."""
    table = rnd(H, K, seed=30) if mode == "bias" else rnd(H, D, K, seed=31)
    x = None if mode == "bias" else rnd(B, H, LK, D, seed=32)
    out = rpe_torch.term(x, [table], "product", mode, "q", *RATIO, SKIP, 0, 0, positions=QP, key_positions=KP)
    assert tuple(out.shape) == ((1, H, LK, L) if mode == "bias" else (B, H, LK, L))
    xu = None
    if mode != "bias":
        xu = torch.zeros(B, H, LU, D, dtype=F64)
        xu[:, :, COLS] = x
    union = rpe_torch.term(xu, [table], "product", mode, "q", *RATIO, SKIP, 0, 0, positions=UNION)
    torch.testing.assert_close(out, union[:, :, COLS][:, :, :, ROWS], rtol=0, atol=1e-14)
    torch.testing.assert_close(out, term(x, [table], mode, "q", QP, KP).transpose(-1, -2), rtol=0, atol=0)


@pytest.mark.parametrize("mode,target", CASES)
def test_term_gradcheck(mode, target):
    if mode == "bias":
        table, x = rnd(H, K, seed=6, grad=True), None
        assert torch.autograd.gradcheck(lambda t: term(None, [t], mode, target, QP, KP), (table,))
        return
    table = rnd(H, K, D, seed=7, grad=True) if target == "v" else rnd(1, D, K, seed=8, grad=True)
    x = rnd(1, H, L, LK, seed=9, grad=True) if target == "v" else rnd(1, H, L if target == "k" else LK, D, seed=10,
                                                                      grad=True)
    assert torch.autograd.gradcheck(lambda x, t: term(x, [t], mode, target, QP, KP), (x, table))


@pytest.mark.parametrize("mode,target", CASES)
def test_opcheck_term(mode, target):
    if mode == "bias":
        x, t = None, rnd(H, K, seed=11)
    elif target == "v":
        x, t = rnd(B, H, L, LK, seed=12), rnd(H, K, D, seed=13)
    else:
        x, t = rnd(B, H, L if target == "k" else LK, D, seed=14), rnd(H, D, K, seed=15)
    args = (x, [t], "product", mode, target, *RATIO, SKIP, 0, 0, QP, KP)
    out = ops.term_forward(*args)
    assert out.shape[-2:] == ((L, D) if target == "v" else (L, LK))
    torch.library.opcheck(ops.term_forward, args)
    back = (x, [t], rnd(*out.shape, seed=16), "product", mode, target, *RATIO, SKIP, 0, 0, QP, KP)
    torch.library.opcheck(ops.term_backward, back)


def modules(rpe_on, mode, shared_head, seed=0):
    """(rpe_q, rpe_k, rpe_v) float64 modules with random tables (product, ratio 1.9, skip 1)."""
    return random_irpe_modules(D, H, rpe_on, mode, shared_head, seed, skip=SKIP, std=0.5)


def written_out(q, k, v, ms):
    """softmax(qs·kᵀ + rpe_k(qs) + rpe_q(k·s)ᵀ)·v + rpe_v(a), the modules at the positions: rpe_q
    runs on the keys (their positions first), as the reference's rpe_q(k·s).transpose(2, 3)."""
    rq, rk, rv = ms
    qs, ks = q * D ** -0.5, k * D ** -0.5
    logits = qs @ k.transpose(-1, -2)
    if rk is not None:
        logits = logits + rk(qs, positions=QP, key_positions=KP)
    if rq is not None:
        logits = logits + rq(ks, positions=KP, key_positions=QP).transpose(2, 3)
    a = torch.softmax(logits, -1)
    out = a @ v
    if rv is not None:
        out = out + rv(a, positions=QP, key_positions=KP)
    return out


ATTENTION_CASES = [("k", "bias", True), ("q", "bias", False), ("k", "contextual", False), ("q", "contextual", True),
                   ("v", "contextual", False), ("qkv", "contextual", False), ("qk", "bias", True)]


@pytest.mark.parametrize("rpe_on,mode,shared", ATTENTION_CASES)
@pytest.mark.parametrize("save_attn", [False, True])
def test_attention_with_terms_matches_the_written_out_attention(rpe_on, mode, shared, save_attn):
    ms = modules(rpe_on, mode, shared, seed=3)
    q, k, v = rnd(B, H, L, D, seed=21, grad=True), rnd(B, H, LK, D, seed=22, grad=True), rnd(B, H, LK, D, seed=23,
                                                                                               grad=True)
    out = rpe_torch.attention(q, k, v, *ms, rpe_positions=QP, rpe_key_positions=KP, save_attn=save_attn)
    assert out.shape == (B, H, L, D)
    ref = written_out(q, k, v, ms)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    params = [p for m in ms if m is not None for p in m.parameters()]
    go = rnd(B, H, L, D, seed=24)
    got = torch.autograd.grad(out, [q, k, v, *params], go)
    want = torch.autograd.grad(ref, [q, k, v, *params], go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


def test_attention_with_terms_gradcheck():
    ms = modules("qkv", "contextual", False, seed=5)
    q, k, v = rnd(1, H, L, D, seed=31, grad=True), rnd(1, H, LK, D, seed=32, grad=True), rnd(1, H, LK, D, seed=33,
                                                                                               grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: rpe_torch.attention(q, k, v, *ms, rpe_positions=QP, rpe_key_positions=KP), (q, k, v))


def attention_args():
    """attention_forward's arguments: a contextual k table and a bias q table at QP / KP."""
    q, k, v = rnd(B, H, L, D, seed=41), rnd(B, H, LK, D, seed=42), rnd(B, H, LK, D, seed=43)
    tq, tk = rnd(H, K, seed=44), rnd(1, D, K, seed=45)
    params = [*RATIO, 1.0] * 2 + [0.0] * 4  # v: no method, params 0 (make_attention_args refuses others)
    # height, width: checked by the operator, not read by the terms at positions
    return attention_op_args(q, k, v, [tq], [tk], [], "product", "bias", "product", "contextual", "", "", params, 2, 2,
                             rpe_positions=QP, rpe_key_positions=KP)


@pytest.mark.parametrize("name", ["attention_forward", "attention_forward_attn"])
def test_opcheck_attention_with_terms(name):
    op = getattr(ops, name)
    args = attention_args()
    out = op(*args)
    if name == "attention_forward_attn":
        assert out[1].shape == (B, H, L, LK)
    torch.library.opcheck(op, args)


def test_attention_refusals_name_the_argument():
    ms = modules("k", "contextual", False, seed=6)
    q, k, v = rnd(B, H, L, D, seed=51), rnd(B, H, LK, D, seed=52), rnd(B, H, LK, D, seed=53)
    # the binding's checks, naming the arguments passed (test_cross.py has the whole messages)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rpe_k is attached with keys of another length than the queries "
                                         r"\(L = 5, L_k = 7\) and no rpe_positions"):
        rpe_torch.attention(q, k, v, *ms, height=2, width=2)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rpe_key_positions is not given with keys of another length than "
                                         r"the queries \(L = 5, L_k = 7\) and rpe_k attached"):
        rpe_torch.attention(q, k, v, *ms, rpe_positions=QP)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rpe_key_positions has shape \(4, 2\); expected \(6 = L_k - skip = "
                                         r"7 - 1 of rpe_k"):
        rpe_torch.attention(q, k, v, *ms, rpe_positions=QP, rpe_key_positions=QP)


def test_a_float_tensor_on_another_device_is_named_before_the_positions():
    """q (attention) or x (term) on the meta device with CPU positions: the float tensor is named,
    not the positions (the index checks read their device from it)."""
    ms = modules("k", "contextual", False, seed=7)
    q, k, v = rnd(B, H, L, D, seed=54), rnd(B, H, LK, D, seed=55), rnd(B, H, LK, D, seed=56)
    with pytest.raises(ValueError, match=r"\[rpe.torch\] q is on device meta; expected cpu"):
        rpe_torch.attention(q.to("meta"), k, v, *ms, rpe_positions=QP, rpe_key_positions=KP)
    with pytest.raises(ValueError, match=r"\[rpe.torch\] x is on device meta; expected cpu"):
        rpe_torch.term(q.to("meta"), [rnd(H, D, K, seed=57)], "product", "contextual", "k", *RATIO, SKIP, 0, 0,
                       positions=QP, key_positions=KP)
