"""Cross-attention through rpe_torch.attention (CPU): keys and values of another length than the
queries (L_k != L). A small SAM2-like memory attention: queries on a 2 x 3 grid, keys on that grid
repeated once per memory frame (rope key_positions = the repeated grid), RoPE-Axial with SAM2's
theta; against the rotations by the RoPE module followed by a plain softmax attention, with
torch.autograd.gradcheck in float64 (q, k, v), masks of the keys' length, the saved probabilities
(B, H, L, L_k), torch.library.opcheck of the three attention operators, and the refusals (an iRPE
term with L_k != L, v of another length than k)."""
import pytest
import torch

import rpe_torch as irpe

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
    out = op(*args)
    if name == "attention_forward_attn":
        assert out[1].shape == (B, H, h * w, R * h * w)  # (B, H, L, L_k)
    torch.library.opcheck(op, args)


def test_opcheck_cross_backward():
    args = cross_args()
    out, attn = ops.attention_forward_attn(*args)
    q, k, v = (t.detach() for t in args[:3])
    go = rnd(*out.shape, grad=False, seed=15)
    back = (q, k, v, *args[3:17], None, go, "axial", [10000.0], None, 0, attn.detach(), "pairs", None, key_positions(), 0)
    grads = ops.attention_backward(*back)
    assert [tuple(g.shape) for g in grads[:3]] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
    torch.library.opcheck(ops.attention_backward, back)


def test_cross_attention_refusals_name_the_argument():
    q, k, v = rnd(B, H, 6, D, seed=21), rnd(B, H, 9, D, seed=22), rnd(B, H, 9, D, seed=23)
    with pytest.raises(ValueError, match=r"\[rpe\.attention\] v has shape \(2, 2, 8, 8\); expected \(2, 2, 9, 8\), "
                                         r"the shape of k"):
        irpe.attention(q, k, v[:, :, :8], height=2, width=3)
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(2, 6\); expected \(2, 9\)"):
        irpe.attention(q, k, v, height=2, width=3, key_padding_mask=torch.zeros(B, 6, dtype=torch.bool))
    term = irpe.RelPosBias((2, 3), H).double()
    # rpe::not_supported (a ValueError): the terms' ids pair the tokens of one sequence
    with pytest.raises(ValueError, match=r"rpe_k is attached with keys of another length than the queries "
                                         r"\(L = 6, L_k = 9\)"):
        irpe.attention(q, k, v, rpe_k=term, height=2, width=3)
