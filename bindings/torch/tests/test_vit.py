"""rpe_torch's vision-transformer encodings: torch.autograd.gradcheck in float64 of every new
operator (RoPE in x and the Mixed frequencies, alone and in the fused attention; Swin / BEiT tables
in timm's layout; SwinV2 CPB in the MLP output; SAM's resize and both tables; the attention with
2D ALiBi), equality with the committed golden data of the public sources (tests/data/golden_vit,
format in its READMEs), and bad input raising ValueError / TypeError with the library's message."""
import json
import math

import numpy as np
import pytest
import torch

from torch.nn.utils.stateless import functional_call

import rpe_torch as rt
from rpe_torch._registrations import attention_op_args as G  # the attention operators' grouped arguments
from conftest import ROOT, assert_close

GOLDEN = ROOT / "tests" / "data" / "golden_vit"
F64 = torch.float64


def rand(*shape, seed, grad=True, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)


def npy(path, dtype=None):
    t = torch.from_numpy(np.load(path))
    return t.to(dtype) if dtype is not None else t


class Wrap(torch.nn.Module):
    """rpe_torch.attention(q, k, v, *terms, rope=rope) as a module, for functional_call."""

    def __init__(self, rope=None, terms=(None, None, None), scale=None, grid=(2, 3), positions=None, key_positions=None):
        super().__init__()
        self.rope, self.scale, self.grid = rope, scale, grid
        self.positions, self.key_positions = positions, key_positions
        self.terms = torch.nn.ModuleList([t if t is not None else torch.nn.Identity() for t in terms])
        self.present = [t is not None for t in terms]

    def forward(self, q, k, v):
        terms = [t if p else None for t, p in zip(self.terms, self.present)]
        return rt.attention(q, k, v, *terms, height=self.grid[0], width=self.grid[1], scale=self.scale, rope=self.rope,
                            positions=self.positions, key_positions=self.key_positions)


def gradcheck(f, inputs):
    return torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# 2D RoPE
# ---------------------------------------------------------------------------------------------

ROPES = {
    "axial": lambda skip: rt.RoPEAxial(theta=100.0, skip=skip),
    "cat_eva02": lambda skip: rt.RoPECat(temperature=10000.0, ref_feat_shape=(4, 4), skip=skip),
    "cat_pixels_xy": lambda skip: rt.RoPECat(in_pixels=True, max_res=32, linear_bands=True, grid_offset=0.0,
                                             grid_indexing="xy", skip=skip),
    "mixed": lambda skip: rt.RoPEMixed(num_heads=2, head_dim=8, theta=10.0, skip=skip),
    "dinov3_aug": lambda skip: rt.RoPEDinoV3(8, min_period=0.5, max_period=40.0, normalize_coords="max",
                                             shift=(0.1, -0.2), jitter=(0.9, 1.2), rescale=1.3, skip=skip),
}


@pytest.mark.parametrize("form", sorted(ROPES))
@pytest.mark.parametrize("skip", [0, 2])
@pytest.mark.parametrize("layout", ["pairs", "half"])
def test_rope_gradcheck(form, skip, layout):
    torch.manual_seed(0)
    m = ROPES[form](skip).double()
    m.layout = layout
    x = rand(2, 2, skip + 6, 8, seed=1)
    mixed = isinstance(m, rt.RoPEMixed)

    def f(x, *freqs):  # the module with its frequencies replaced by the checked input
        return functional_call(m, {"freqs": freqs[0]} if mixed else {}, (x, 2, 3))

    y = m(x, 2, 3)
    assert torch.equal(y[:, :, :skip], x[:, :, :skip])  # skip tokens unrotated
    assert not torch.allclose(y[:, :, skip + 1:], x[:, :, skip + 1:])  # grid tokens after the first turn
    inputs = (x,) + ((m.freqs.detach().clone().requires_grad_(),) if mixed else ())
    assert gradcheck(f, inputs)


def test_rope_mixed_module_grad_reaches_freqs():
    m = rt.RoPEMixed(num_heads=3, head_dim=8, skip=1).double()
    x = rand(2, 3, 13, 8, seed=2)
    w = rand(2, 3, 13, 8, seed=3).detach()  # not pow(2): a rotation keeps the norm (a zero gradient up to rounding)
    (m(x, 4, 3) * w).sum().backward()
    assert m.freqs.grad is not None and m.freqs.grad.shape == (2, 3, 4) and m.freqs.grad.abs().sum() > 1e-3
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16])
def test_rope_mixed_module_builds_under_another_default_dtype(default):
    """RoPEMixed makes its angles in float32 (rope_mixed_init's dtype) whatever the default dtype;
    the same seed gives the same frequencies as under the float32 default."""
    torch.manual_seed(5)
    want = rt.RoPEMixed(num_heads=3, head_dim=8).freqs.detach()
    old = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        torch.manual_seed(5)
        got = rt.RoPEMixed(num_heads=3, head_dim=8).freqs.detach()
        zero = rt.RoPEMixed(num_heads=3, head_dim=8, rotate=False).freqs.detach()
    finally:
        torch.set_default_dtype(old)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert zero.dtype == torch.float32 and zero.shape == (2, 3, 4)


def rope_cases():
    return sorted(p.parent for p in (GOLDEN / "rope").glob("*/meta.json"))


def rope_module(meta):
    skip, layout = meta["skip"], meta.get("layout", "pairs")
    if meta["form"] == "axial":
        return rt.RoPEAxial(theta=meta["theta"], skip=skip, layout=layout)
    if meta["form"] == "mixed":
        return rt.RoPEMixed(num_heads=meta["heads"], head_dim=meta["head_dim"], skip=skip, layout=layout)
    if meta["form"] == "mrope":
        return rt.RoPEMRoPE(tuple(meta["sections"]), theta=meta["theta"], interleaved=meta["interleaved"], skip=skip,
                            layout=layout, suffix=meta.get("suffix", 0))
    if meta["form"] == "vjepa2":
        frames, rows, cols = meta["grid_thw"]
        return rt.RoPEVJEPA2(theta=meta["theta"], grid_depth=frames, grid_size=(rows, cols), head_dim=meta["head_dim"],
                             skip=skip, suffix=meta.get("suffix", 0))
    if meta["form"] == "dinov3":
        return rt.RoPEDinoV3(meta["head_dim"], temperature=meta.get("base"), min_period=meta.get("min_period"),
                             max_period=meta.get("max_period"), normalize_coords=meta["normalize"],
                             shift=meta.get("shift", (0.0, 0.0)), jitter=meta.get("jitter", (1.0, 1.0)),
                             rescale=meta.get("rescale", 1.0), skip=skip, layout=layout)
    return rt.RoPECat(temperature=meta.get("temperature", 10000.0), in_pixels=meta.get("in_pixels", False),
                      max_res=meta.get("max_res", 224.0), linear_bands=meta.get("linear_bands", False),
                      grid_offset=meta.get("grid_offset", 0.0), ref_feat_shape=meta.get("ref_feat_shape"),
                      grid_indexing=meta.get("grid_indexing", "ij"), skip=skip, layout=layout)


@pytest.mark.parametrize("case", [c for c in rope_cases() if c.name.startswith("sam2_")], ids=lambda p: p.name)
def test_rope_sam2_golden(case):
    """sam2's RoPEAttention (tools/golden/gen_sam2_rope.py): RoPEAxial(theta=10000) on the query
    grid; the keys at the grid repeated once per memory frame, the object-pointer suffix unrotated;
    the keys' input gradient. float32, the C++ test's tolerances."""
    meta = json.loads((case / "meta.json").read_text())
    h, w, repeat, suffix = meta["height"], meta["width"], meta["repeat"], meta["suffix"]
    q = npy(case / "q.npy")
    assert_close(rt.RoPEAxial(theta=meta["theta"])(q, h, w), np.load(case / "q_rot.npy"), 1e-6, 1e-5, "q")
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    grid = torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=1)
    k = npy(case / "k.npy").requires_grad_()
    k_rot = rt.RoPEAxial(theta=meta["theta"], suffix=suffix)(k, positions=grid.repeat(repeat, 1))
    assert_close(k_rot, np.load(case / "k_rot.npy"), 1e-6, 1e-5, "k")
    k_rot.backward(npy(case / "grad_k_rot.npy"))
    assert_close(k.grad, np.load(case / "grad_k.npy"), 1e-6, 1e-5, "grad_k")


@pytest.mark.parametrize("case", rope_cases(), ids=lambda p: p.name)
def test_rope_golden(case):
    """rope-vit's apply_rotary_emb / timm's apply_rot_embed_cat (half=False and half=True) / timm's
    RotaryEmbeddingDinoV3 / Qwen2-VL's vision RoPE (RoPECat, half, at the patches' positions) /
    transformers' VJEPA2RopeAttention (RoPEVJEPA2 at get_position_ids' (frame, row, col) ids): y,
    grad_x (and grad_freqs) where the case has them, float32, the C++ test's tolerances. Without a golden gradient the backward is checked as the transpose
    rotation: <y, g> = <x, grad_x> and grad_x = R⁻¹ g (a rotation's inverse is its transpose)."""
    meta = json.loads((case / "meta.json").read_text())
    if meta["form"] == "sam2":
        pytest.skip("SAM2's queries and keys: test_rope_sam2_golden")
    m = rope_module(meta)
    if isinstance(m, rt.RoPEMixed):
        with torch.no_grad():
            m.freqs.copy_(npy(case / "freqs.npy"))
    x = npy(case / "x.npy").requires_grad_()
    on_grid = "height" in meta  # else the case is per-token positions only (Qwen2-VL's vision RoPE)
    y = m(x, meta["height"], meta["width"]) if on_grid else m(x, positions=npy(case / "positions.npy"))
    assert_close(y, np.load(case / "y.npy"), 2e-5, 2e-5, "y")
    skip = meta["skip"]
    assert torch.equal(y[:, :, :skip], x[:, :, :skip])  # class / storage tokens unrotated
    if (case / "grad_y.npy").exists():
        y.backward(npy(case / "grad_y.npy"))
        assert_close(x.grad, np.load(case / "grad_x.npy"), 2e-5, 2e-5, "grad_x")
    else:
        g = torch.from_numpy(np.load(case / "y.npy"))  # any upstream gradient; the rotated x rotates back to x
        y.backward(g)
        assert_close(x.grad, x.detach().numpy(), 2e-5, 2e-5, "grad_x = R^T y = x")
    if isinstance(m, rt.RoPEMixed):
        assert_close(m.freqs.grad, np.load(case / "grad_freqs.npy"), 1e-4, 1e-4, "grad_freqs")
    if on_grid and (case / "positions.npy").exists():
        # DINOv3's own coordinates of the grid as per-token positions: the grid's result exactly
        pos = npy(case / "positions.npy")
        assert pos.shape == (meta["height"] * meta["width"], 2)
        assert torch.equal(m(x.detach(), positions=pos), y.detach())


def test_rope_golden_in_attention_equals_rotated_inputs():
    """attention(rope=m) on the golden mixed case equals the attention on rope-vit's rotated q, k;
    the frequencies' gradient equals the sum of the standalone rotations' gradients."""
    case = GOLDEN / "rope" / "mixed_t10_4x3_skip1"
    meta = json.loads((case / "meta.json").read_text())
    m = rope_module(meta).double()
    with torch.no_grad():
        m.freqs.copy_(npy(case / "freqs.npy"))
    x = npy(case / "x.npy", F64)
    q, k, v = x.clone().requires_grad_(), x.flip(2).clone().requires_grad_(), x.roll(1, 3).clone().requires_grad_()
    out = rt.attention(q, k, v, rope=m, height=4, width=3)
    out.sum().backward()
    fused = (q.grad.clone(), k.grad.clone(), m.freqs.grad.clone())
    q.grad = k.grad = m.freqs.grad = None
    qr, kr = m(q, 4, 3), m(k, 4, 3)
    a = torch.softmax(qr @ kr.transpose(-1, -2) * meta["head_dim"] ** -0.5, -1)
    ref = a @ v
    assert_close(out, ref.detach().numpy(), 1e-12, 1e-10, "out")
    assert_close(qr, np.load(case / "y.npy"), 2e-5, 2e-5, "rotated q")
    ref.sum().backward()
    for got, want, name in zip(fused, (q.grad, k.grad, m.freqs.grad), ("grad_q", "grad_k", "grad_freqs")):
        assert_close(got, want.numpy(), 1e-11, 1e-9, name)


@pytest.mark.parametrize("form", ["axial", "mixed", "cat_eva02"])
def test_attention_rope_gradcheck(form):
    torch.manual_seed(3)
    m = ROPES[form](1).double()
    q, k, v = (rand(2, 2, 7, 8, seed=s) for s in (4, 5, 6))
    freqs = (m.freqs.detach().clone().requires_grad_(),) if form == "mixed" else ()

    def f(q, k, v, *fr):
        with_freqs = {"freqs": fr[0]} if fr else {}
        return functional_call(Wrap(m), {f"rope.{n}": t for n, t in with_freqs.items()}, (q, k, v))

    assert gradcheck(f, (q, k, v) + freqs)


def test_attention_rope_with_irpe_and_scale_gradcheck():
    """RoPE-Mixed with a contextual iRPE term on q, k, v and a non-default scale."""
    cfg = rt.get_rpe_config(ratio=1.0, method=rt.METHOD.PRODUCT, mode="contextual", shared_head=True, skip=1,
                            rpe_on="qkv")
    mods = [mm.double() for mm in rt.build_rpe(cfg, head_dim=4, num_heads=2)]
    with torch.no_grad():
        for i, mm in enumerate(mods):
            mm.lookup_table_weight.copy_(rand(*mm.lookup_table_weight.shape, seed=20 + i, grad=False))
    m = rt.RoPEMixed(num_heads=2, head_dim=4, skip=1).double()
    fr = m.freqs.detach().clone().requires_grad_()
    q, k, v = (rand(1, 2, 7, 4, seed=s) for s in (7, 8, 9))

    def f(q, k, v, fr):
        return functional_call(Wrap(m, mods, scale=0.7), {"rope.freqs": fr}, (q, k, v))

    assert gradcheck(f, (q, k, v, fr))


# ---------------------------------------------------------------------------------------------
# RoPE: per-token positions, the unrotated suffix, DINOv3 against timm
# ---------------------------------------------------------------------------------------------

def grid_positions(height, width, times=1, dtype=torch.int64):
    """(times·height·width, 2) (row, col) of a height × width grid, row-major, `times` over."""
    rows = torch.arange(height).repeat_interleave(width)
    cols = torch.arange(width).repeat(height)
    return torch.stack([rows, cols], 1).repeat(times, 1).to(dtype)


#: real-valued (row, col) positions of 5 tokens (off the grid, negative, between cells)
REAL_POSITIONS = torch.tensor([[0.5, 1.25], [2.0, -1.0], [3.5, 0.0], [-0.75, 2.5], [1.0, 1.0]], dtype=F64)

#: forms whose angle at integer positions (row, col) is the grid's (rpe::rope::*::angle_at)
GRID_FORMS = {
    "axial": lambda: rt.RoPEAxial(theta=100.0, skip=1),
    "mixed": lambda: rt.RoPEMixed(num_heads=2, head_dim=8, theta=10.0, skip=1),
    "cat": lambda: rt.RoPECat(temperature=10000.0, skip=1),
}


@pytest.mark.parametrize("form", sorted(GRID_FORMS))
@pytest.mark.parametrize("layout", ["pairs", "half"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.float64], ids=str)
def test_rope_positions_equal_to_the_grid_give_the_grid_result(form, layout, dtype):
    """positions = the grid's (row, col): the rotation and its gradients are the grid's bit for
    bit; the fused attention with positions = key_positions = the grid equals the grid's."""
    torch.manual_seed(4)
    m = GRID_FORMS[form]().double()
    m.layout = layout
    x = rand(2, 2, 1 + 12, 8, seed=30)
    pos = grid_positions(3, 4, dtype=dtype)
    g = rand(*x.shape, seed=31, grad=False)
    params = [x] + ([m.freqs] if form == "mixed" else [])
    y, yp = m(x, 3, 4), m(x, positions=pos)
    assert torch.equal(y, yp)
    for a, b in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(yp, params, g)):
        assert torch.equal(a, b)
    q, k, v = (rand(2, 2, 13, 8, seed=s) for s in (32, 33, 34))
    out = rt.attention(q, k, v, rope=m, height=3, width=4)
    outp = rt.attention(q, k, v, rope=m, positions=pos, key_positions=pos)
    assert_close(outp, out.detach().numpy(), 1e-13, 1e-12, "out")
    for a, b in zip(torch.autograd.grad(out, [q, k, v] + params[1:], g), torch.autograd.grad(outp, [q, k, v] + params[1:], g)):
        assert_close(b, a.numpy(), 1e-12, 1e-11, "gradient")


@pytest.mark.parametrize("form", sorted(ROPES))
@pytest.mark.parametrize("layout", ["pairs", "half"])
def test_rope_positions_gradcheck(form, layout):
    """Real-valued positions, skip 1 and suffix 2: the leading and trailing tokens are copied, the
    others rotated at their positions; gradcheck in x (and the Mixed frequencies)."""
    torch.manual_seed(5)
    m = ROPES[form](1).double()
    m.layout, m.suffix = layout, 2
    x = rand(2, 2, 1 + 5 + 2, 8, seed=35)
    mixed = isinstance(m, rt.RoPEMixed)
    y = m(x, positions=REAL_POSITIONS)
    assert torch.equal(y[:, :, :1], x[:, :, :1]) and torch.equal(y[:, :, -2:], x[:, :, -2:])
    assert not torch.allclose(y[:, :, 1:-2], x[:, :, 1:-2])
    assert_close(y.norm(dim=-1), x.norm(dim=-1).detach().numpy(), 1e-12, 1e-12, "norms (a rotation)")

    def f(x, *freqs):
        return functional_call(m, {"freqs": freqs[0]} if mixed else {}, (x,), {"positions": REAL_POSITIONS})

    assert gradcheck(f, (x,) + ((m.freqs.detach().clone().requires_grad_(),) if mixed else ()))


def test_rope_repeated_grid_positions_and_suffix():
    """SAM2's memory keys: two frames of a 2 × 3 grid at the same positions, then 3 unrotated
    (object pointer) tokens; each frame is rotated as the grid, exactly."""
    m = rt.RoPEAxial(theta=10000.0, suffix=3, layout="half").double()
    x = rand(1, 2, 2 * 6 + 3, 8, seed=36, grad=False)
    y = m(x, positions=grid_positions(2, 3, times=2))
    grid = rt.RoPEAxial(theta=10000.0, layout="half").double()
    assert torch.equal(y[:, :, :6], grid(x[:, :, :6], 2, 3))
    assert torch.equal(y[:, :, 6:12], grid(x[:, :, 6:12], 2, 3))
    assert torch.equal(y[:, :, 12:], x[:, :, 12:])
    # the grid with a suffix: L = skip + height·width + suffix
    assert torch.equal(m(x[:, :, 6:], 2, 3), torch.cat([grid(x[:, :, 6:12], 2, 3), x[:, :, 12:]], 2))


@pytest.mark.parametrize("form", ["axial", "mixed", "dinov3_aug"])
def test_attention_rope_positions_equals_rotated_inputs_and_gradcheck(form):
    """attention(rope=m, positions=P, key_positions=Pk) with layout half and a suffix equals the
    softmax attention of m(q, positions=P) and m(k, positions=Pk); gradcheck in q, k, v (and the
    Mixed frequencies)."""
    torch.manual_seed(6)
    m = ROPES[form](1).double()
    m.layout, m.suffix = "half", 1
    q, k, v = (rand(2, 2, 7, 8, seed=s) for s in (37, 38, 39))
    kpos = REAL_POSITIONS.flip(0) * 0.5
    out = rt.attention(q, k, v, rope=m, positions=REAL_POSITIONS, key_positions=kpos)
    qr, kr = m(q, positions=REAL_POSITIONS), m(k, positions=kpos)
    ref = torch.softmax(qr @ kr.transpose(-1, -2) * 8 ** -0.5, -1) @ v
    assert_close(out, ref.detach().numpy(), 1e-12, 1e-10, "out")
    other = rt.attention(q, k, v, rope=m, positions=REAL_POSITIONS)  # keys at the queries' positions
    assert not torch.allclose(other, out)
    freqs = (m.freqs.detach().clone().requires_grad_(),) if form == "mixed" else ()
    wrap = Wrap(m, positions=REAL_POSITIONS, key_positions=kpos)

    def f(q, k, v, *fr):
        return functional_call(wrap, {"rope.freqs": fr[0]} if fr else {}, (q, k, v))

    assert gradcheck(f, (q, k, v) + freqs)


def test_attention_rope_key_positions_with_query_grid():
    """Queries on the grid, keys at their own positions (another grid): equals rotating each."""
    m = rt.RoPEAxial(theta=10.0, skip=1).double()
    q, k, v = (rand(1, 2, 7, 8, seed=s, grad=False) for s in (40, 41, 42))
    kpos = grid_positions(2, 3) * 2 + 1
    out = rt.attention(q, k, v, rope=m, height=2, width=3, key_positions=kpos)
    qr, kr = m(q, 2, 3), m(k, positions=kpos)
    ref = torch.softmax(qr @ kr.transpose(-1, -2) * 8 ** -0.5, -1) @ v
    assert_close(out, ref.numpy(), 1e-12, 1e-10, "out")


def test_dinov3_positions_golden_and_default_layout():
    """RoPEDinoV3's default layout is half (DINOv3's); the golden case's own coordinates as
    positions give the golden y, and the layout pairs another result."""
    case = GOLDEN / "rope" / "dinov3_base100_4x6_skip5"
    meta = json.loads((case / "meta.json").read_text())
    m = rt.RoPEDinoV3(meta["head_dim"], skip=meta["skip"])
    assert m.layout == "half" and m.rotate_half
    x = npy(case / "x.npy")
    y = m(x, positions=npy(case / "positions.npy"))
    assert_close(y, np.load(case / "y.npy"), 2e-5, 2e-5, "y at positions")
    m.layout = "pairs"
    assert not torch.allclose(m(x, meta["height"], meta["width"]), y)


TIMM_DINOV3 = {
    "base": dict(temperature=100.0),
    "minmax_max": dict(temperature=None, min_period=0.5, max_period=40.0, normalize_coords="max"),
    "aug_min": dict(normalize_coords="min", shift_coords=0.3, jitter_coords=1.5, rescale_coords=2.0),
    "pairs": dict(temperature=50.0, rotate_half=False),
}


@pytest.mark.parametrize("name", sorted(TIMM_DINOV3))
def test_dinov3_module_equals_timm(name):
    """RoPEDinoV3.from_timm(timm's RotaryEmbeddingDinoV3): the same buffers and state dict (timm's
    loads with strict=True), the same periods, and the rotation of timm's get_embed +
    apply_rot_embed_cat; in train mode with augmentation, the values drawn by
    sample_augmentation from the same seed are timm's draws (float32, ≤ 1e-5)."""
    pytest.importorskip("timm")
    from timm.layers.pos_embed_sincos import RotaryEmbeddingDinoV3, apply_rot_embed_cat
    t = RotaryEmbeddingDinoV3(16, feat_shape=[3, 5], **TIMM_DINOV3[name])
    m = rt.RoPEDinoV3.from_timm(t, skip=2)
    m.load_state_dict(t.state_dict(), strict=True)
    assert set(m.state_dict()) == set(t.state_dict())
    assert {n for n, _ in m.named_buffers()} <= {n for n, _ in t.named_buffers()}
    assert torch.equal(m.periods, t.periods)
    assert m.rotate_half == t.rotate_half
    x = torch.randn(2, 3, 2 + 15, 16, generator=torch.Generator().manual_seed(43))
    t.train()
    torch.manual_seed(44)
    emb = t.get_embed([3, 5])
    torch.manual_seed(44)
    shift, jitter, rescale = m.sample_augmentation()
    assert (shift != (0.0, 0.0)) == (t.shift_coords is not None)
    want = torch.cat([x[:, :, :2], apply_rot_embed_cat(x[:, :, 2:], emb, half=t.rotate_half)], 2)
    assert_close(m(x, 3, 5), want.numpy(), 1e-5, 1e-5, "y")
    t.eval()
    m.shift, m.jitter, m.rescale = (0.0, 0.0), (1.0, 1.0), 1.0
    want = torch.cat([x[:, :, :2], apply_rot_embed_cat(x[:, :, 2:], t.get_embed(), half=t.rotate_half)], 2)
    assert_close(m(x, 3, 5), want.numpy(), 1e-5, 1e-5, "y (eval)")


# ---------------------------------------------------------------------------------------------
# Swin / BEiT relative position bias
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,window,skip", [("swin", (2, 3), 0), ("swin", (3, 2), 1), ("beit", (2, 3), 1),
                                              ("beit", (2, 2), 0)])
def test_rel_pos_bias_gradcheck(kind, window, skip):
    m = rt.RelPosBias(window, num_heads=2, kind=kind, skip=skip).double()
    t = rand(*m.relative_position_bias_table.shape, seed=10)

    def f(t):
        return rt.TermSlot(kind, [rt.table_from_timm(t)], window, skip)()

    out = f(t)
    L = skip + window[0] * window[1]
    assert out.shape == (1, 2, L, L)
    assert gradcheck(f, (t,))
    assert gradcheck(rt.table_to_timm, (rand(3, 5, seed=11),))


def test_rel_pos_bias_in_attention_gradcheck():
    """BEiT's bias (class token) with RoPE-Axial in the fused attention: q, k, v and the timm table."""
    m = rt.RelPosBias((2, 3), num_heads=2, kind="beit").double()
    t0 = rand(*m.relative_position_bias_table.shape, seed=12)
    q, k, v = (rand(2, 2, 7, 4, seed=s) for s in (13, 14, 15))
    rope = rt.RoPEAxial(skip=1)

    def f(q, k, v, t):
        return rt.attention(q, k, v, rpe_k=rt.TermSlot("beit", [rt.table_from_timm(t)], (2, 3), 1), rope=rope)

    assert gradcheck(f, (q, k, v, t0))


@pytest.mark.parametrize("kind,name,window", [("swin", "index_7x7", (7, 7)), ("swin", "index_3x5", (3, 5)),
                                              ("swin", "index_4x2", (4, 2)), ("beit", "index_3x4", (3, 4)),
                                              ("beit", "index_2x2", (2, 2))])
def test_swin_beit_index_golden(kind, name, window):
    skip = 1 if kind == "beit" else 0
    ids = rt.bucket_ids(kind, window[0], window[1], 0, skip, *window)
    assert ids.shape[0] == 1
    assert np.array_equal(ids[0].numpy(), np.load(GOLDEN / kind / f"{name}.npy"))


@pytest.mark.parametrize("kind,window", [("swin", (3, 5)), ("beit", (3, 4))])
def test_swin_beit_bias_golden(kind, window):
    """timm's _get_rel_pos_bias() from its (K, H) table loaded into the module (exact: a gather)."""
    tag = f"{window[0]}x{window[1]}"
    m = rt.RelPosBias(window, num_heads=2, kind=kind)
    m.load_state_dict({"relative_position_bias_table": npy(GOLDEN / kind / f"table_kh_{tag}.npy")})
    assert_close(m(), np.load(GOLDEN / kind / f"bias_{tag}.npy"), 0, 0, f"{kind} bias")
    assert torch.equal(rt.table_to_timm(rt.table_from_timm(m.relative_position_bias_table)), m.relative_position_bias_table)
    plain = rt.RelPosBias(window, num_heads=2, kind=kind, timm_layout=False)
    with torch.no_grad():
        plain.table.copy_(m.relative_position_bias_table.t())
    assert torch.equal(plain(), m())


# ---------------------------------------------------------------------------------------------
# SwinV2 continuous position bias
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sigmoid16", [True, False])
def test_cpb_gradcheck(sigmoid16):
    raw = rand(15, 2, seed=16)  # K of a 2x3 window, H = 2
    assert gradcheck(lambda r: rt.cpb_table(r, (2, 3), sigmoid16), (raw,))
    assert gradcheck(lambda r: rt.cpb_bias(r, (2, 3), sigmoid16), (raw,))
    q, k, v = (rand(1, 2, 6, 4, seed=s) for s in (17, 18, 19))

    def f(q, k, v, r):
        return rt.attention(q, k, v, rpe_k=rt.TermSlot("swin", [rt.cpb_table(r, (2, 3), sigmoid16)], (2, 3)))

    assert gradcheck(f, (q, k, v, raw))


@pytest.mark.parametrize("name,window,pretrained,mode", [
    ("coords_3x5", (3, 5), (0, 0), "swin"), ("coords_8x8_pre12x12", (8, 8), (12, 12), "swin"),
    ("coords_4x6_pre3x5", (4, 6), (3, 5), "swin"), ("coords_3x5_cr", (3, 5), (0, 0), "cr"),
    ("coords_1x4_cr", (1, 4), (0, 0), "cr"), ("cpb_coords_3x5_pre4x4", (3, 5), (4, 4), "swin")])
def test_relative_log_coords_golden(name, window, pretrained, mode):
    """timm's gen_relative_log_coords (float32; within 1 ulp, as the C++ test)."""
    got = rt.relative_log_coords(window, pretrained, mode)
    want = np.load(GOLDEN / "swinv2" / f"{name}.npy")
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert np.all(np.abs(got.numpy() - want) <= np.spacing(np.abs(want).astype(np.float32)))


def test_cpb_golden():
    """SwinV2 WindowAttention(window (3, 5), heads 2, pretrained (4, 4)): the coordinates through the
    user's MLP (plain torch, timm's cpb_mlp weights), the bias, and grad of the MLP output."""
    d = GOLDEN / "swinv2"
    coords = rt.relative_log_coords((3, 5), (4, 4))
    w1, b1, w2 = npy(d / "cpb_w1.npy"), npy(d / "cpb_b1.npy"), npy(d / "cpb_w2.npy")
    raw = torch.relu(coords @ w1.t() + b1) @ w2.t()
    assert_close(raw, np.load(d / "cpb_raw.npy"), 1e-5, 1e-5, "cpb raw (MLP output)")
    raw = npy(d / "cpb_raw.npy").requires_grad_()
    bias = rt.cpb_bias(raw, (3, 5))
    assert_close(bias, np.load(d / "cpb_bias.npy"), 1e-5, 1e-5, "cpb bias")
    bias.backward(npy(d / "cpb_grad_out.npy"))
    assert_close(raw.grad, np.load(d / "cpb_grad_raw.npy"), 1e-5, 1e-4, "cpb grad_raw")
    raw.grad = None
    bias2 = rt.TermSlot("swin", [rt.cpb_table(raw, (3, 5))], (3, 5))()
    assert torch.equal(bias2, bias.detach())


# ---------------------------------------------------------------------------------------------
# SAM decomposed relative position
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lin,lout", [(5, 7), (7, 5), (1, 3), (3, 3)])
def test_resize_gradcheck(lin, lout):
    assert gradcheck(lambda r: rt.resize_rel_pos(r, lout), (rand(lin, 2, seed=lin),))


@pytest.mark.parametrize("h,w,lh,lw,skip", [(2, 3, 3, 5, 0), (3, 2, 4, 6, 1)])
def test_decomposed_gradcheck(h, w, lh, lw, skip):
    q = rand(2, 2, skip + h * w, 3, seed=21)
    rh, rw = rand(lh, 3, seed=22), rand(lw, 3, seed=23)
    assert gradcheck(lambda q, a, b: rt.decomposed_rel_pos(q, a, b, h, w, skip), (q, rh, rw))
    k, v = rand(2, 2, skip + h * w, 3, seed=24), rand(2, 2, skip + h * w, 3, seed=25)
    m = rt.DecomposedRelPos(h, w, 3, rel_pos_lengths=(lh, lw), skip=skip).double()

    def f(q, k, v, a, b):
        return functional_call(Wrap(None, [None, m, None], grid=(None, None)),
                               {"terms.1.rel_pos_h": a, "terms.1.rel_pos_w": b}, (q, k, v))

    assert gradcheck(f, (q, k, v, rh, rw))


def sam_resize_cases():
    return sorted((GOLDEN / "sam" / "resize").iterdir())


@pytest.mark.parametrize("case", sam_resize_cases(), ids=lambda p: p.name)
def test_sam_resize_golden(case):
    rel_pos = npy(case / "rel_pos.npy").requires_grad_()
    out = rt.resize_rel_pos(rel_pos, np.load(case / "resized.npy").shape[0])
    assert_close(out, np.load(case / "resized.npy"), 1e-12, 1e-12, "resized")
    out.backward(npy(case / "grad_out.npy"))
    assert_close(rel_pos.grad, np.load(case / "grad_rel_pos.npy"), 1e-12, 1e-12, "grad_rel_pos")


def test_sam_term_golden():
    """add_decomposed_rel_pos(0, q, ...) of SAM; the file's x is q·D^-1/2."""
    d = GOLDEN / "sam" / "term_4x6"
    x = npy(d / "x.npy")
    q = x * math.sqrt(x.shape[-1])
    out = rt.decomposed_rel_pos(q, npy(d / "rel_pos_h.npy"), npy(d / "rel_pos_w.npy"), 4, 6)
    assert_close(out, np.load(d / "output.npy"), 2e-5, 1e-4, "decomposed terms")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", ["attn_4x6", "attn_5x5_resized", "attn_3x7_resized"])
def test_sam_attention_golden(name, dtype):
    """SAM's Attention(use_rel_pos=True) without proj: rpe_torch.attention with a DecomposedRelPos."""
    d = GOLDEN / "sam" / name
    meta = next(c for c in json.loads((GOLDEN / "sam" / "meta.json").read_text())["attention"] if c["dir"] == name)
    atol, rtol = (1e-10, 1e-9) if dtype == torch.float64 else (2e-5, 1e-4)
    m = rt.DecomposedRelPos(meta["height"], meta["width"], meta["head_dim"],
                            rel_pos_lengths=(meta["rel_pos_h_length"], meta["rel_pos_w_length"])).to(dtype)
    with torch.no_grad():
        m.rel_pos_h.copy_(npy(d / "rel_pos_h.npy"))
        m.rel_pos_w.copy_(npy(d / "rel_pos_w.npy"))
    q, k, v = (npy(d / f"{n}.npy", dtype).requires_grad_() for n in "qkv")
    out = rt.attention(q, k, v, rpe_k=m)
    assert_close(out, np.load(d / "out.npy"), atol, rtol, "out")
    out.backward(npy(d / "grad_out.npy", dtype))
    for t, n in ((q, "grad_q"), (k, "grad_k"), (v, "grad_v"), (m.rel_pos_h, "grad_rel_pos_h"),
                 (m.rel_pos_w, "grad_rel_pos_w")):
        assert_close(t.grad, np.load(d / f"{n}.npy"), atol, rtol, n)


# ---------------------------------------------------------------------------------------------
# 2D ALiBi
# ---------------------------------------------------------------------------------------------

def test_alibi_attention_gradcheck():
    m = rt.ALiBi2D(num_heads=2, height=2, width=3, skip=1, dtype=torch.float64)
    assert m.table.dtype == torch.float64 and not m.table.requires_grad
    q, k, v = (rand(1, 2, 7, 4, seed=s) for s in (26, 27, 28))
    assert gradcheck(lambda q, k, v: rt.attention(q, k, v, rpe_k=m), (q, k, v))
    bias = m()
    assert torch.all(bias[0, :, 0, :] == 0) and torch.all(bias[0, :, :, 0] == 0)  # the skip token


@pytest.mark.parametrize("entry", json.loads((GOLDEN / "alibi" / "meta.json").read_text())["bias"],
                         ids=lambda e: e["file"])
def test_alibi_bias_golden(entry):
    """CROMA's get_2dalibi, float32 bit-exact."""
    m = rt.ALiBi2D(entry["heads"], entry["side"], entry["side"])
    want = np.load(GOLDEN / "alibi" / entry["file"])
    assert np.array_equal(m()[0].numpy(), want)
    assert rt.alibi_slopes(entry["heads"])[0] == pytest.approx(-float(want[0, 0, 1]), rel=1e-7)


def test_alibi_term_golden():
    assert np.array_equal(rt.ALiBi2D(8, 4, 4)().numpy(), np.load(GOLDEN / "alibi" / "term_h8_s4.npy"))
    assert rt.alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]


@pytest.mark.parametrize("entry", json.loads((GOLDEN / "alibi" / "meta.json").read_text())["attention"],
                         ids=lambda e: e["dir"])
def test_alibi_attention_golden(entry):
    d = GOLDEN / "alibi" / entry["dir"]
    m = rt.ALiBi2D(entry["heads"], entry["side"], entry["side"])
    q, k, v = (npy(d / f"{n}.npy").requires_grad_() for n in "qkv")
    out = rt.attention(q, k, v, rpe_k=m)
    assert_close(out, np.load(d / "out.npy"), 1e-5, 1e-4, "out")
    out.backward(npy(d / "grad_out.npy"))
    for t, n in ((q, "grad_q"), (k, "grad_k"), (v, "grad_v")):
        assert_close(t.grad, np.load(d / f"{n}.npy"), 1e-5, 1e-4, n)


# ---------------------------------------------------------------------------------------------
# Errors: the library's messages
# ---------------------------------------------------------------------------------------------

def test_rope_errors():
    x = torch.randn(1, 2, 7, 8)
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] rope needs head_dim D = 6 to be a positive multiple of 4"):
        rt.RoPEAxial(skip=1)(torch.randn(1, 2, 7, 6), 2, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] L = 7; expected rope skip \+ height\*width = 0 \+ 2\*3"):
        rt.RoPEAxial()(x, 2, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] theta = -1; expected finite and > 0"):
        rt.RoPEAxial(theta=-1.0, skip=1)(x, 2, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] ref_height, ref_width = 4, 0; expected both > 0 or both 0"):
        rt.RoPECat(ref_feat_shape=(4, 0), skip=1)(x, 2, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] rope freqs has shape \(2, 3, 4\); expected \(2, 2, 4\)"):
        rt.RoPEMixed(num_heads=3, head_dim=8, skip=1)(x, 2, 3)
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] freqs has dtype torch\.float32 but x has torch\.float64; x, freqs and grad_y "
                                        r"must share one dtype"):
        rt.RoPEMixed(num_heads=2, head_dim=8, skip=1)(x.double(), 2, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] rope freqs is given for a fixed-frequency form"):
        torch.ops.rpe.rope_forward(x, "axial", [100.0], torch.zeros(2, 2, 4), 1, 2, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope form = 'spiral'; expected axial, mixed, cat, dinov3, mrope, vjepa2 or sam2"):
        torch.ops.rpe.rope_forward(x, "spiral", [], None, 1, 2, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope_params holds 2 values for form 'axial'; expected 1"):
        torch.ops.rpe.rope_forward(x, "axial", [1.0, 2.0], None, 1, 2, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] head_dim = 6; expected a positive multiple of 4"):
        rt.RoPEMixed(num_heads=2, head_dim=6)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] L = 7 is not skip \+ a square"):
        rt.RoPEAxial()(x)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] grid_indexing = 'yx'"):
        rt.RoPECat(grid_indexing="yx")
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] rope is a Linear"):
        rt.attention(x, x, x, rope=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"\[rpe\.attention\] .*L = 7"):
        rt.attention(x, x, x, rope=rt.RoPEAxial(skip=0), height=2, width=3)
    # boolean parameters: True / False (or 0 / 1) only; a string or 0.5 is no flag (bool("false") is True)
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] interleaved is a str \('false'\); expected True or False"):
        rt.RoPEMRoPE(sections=(1, 1, 2), interleaved="false")
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] in_pixels = 2; expected True or False \(or 0 / 1\)"):
        rt.RoPECat(in_pixels=2)
    assert rt.RoPECat(linear_bands=1).linear_bands is True and rt.RoPEMRoPE(interleaved=False).interleaved is False
    for bad in (0.5, 2.0, -1.0, math.nan):
        with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope interleaved = .*; expected 0 or 1 \(a flag\)"):
            torch.ops.rpe.rope_forward(x, "mrope", [1e6, 1.0, 1.0, 2.0, bad], None, 1, 2, 3)
    # RoPEDinoV3 is built for one head dim (its periods): another D is refused, not computed as it
    x8 = torch.randn(1, 2, 1 + 6, 16)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] x has shape \(1, 2, 7, 16\); expected D = dim = 8 \(the "
                                         r"RoPEDinoV3 module's\)"):
        rt.RoPEDinoV3(8, skip=1)(x8, 2, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] q has shape \(1, 2, 7, 16\); expected D = dim = 8"):
        rt.attention(x8, x8, x8, rope=rt.RoPEDinoV3(8, skip=1), height=2, width=3)


def test_rope_layout_positions_dinov3_errors():
    x = torch.randn(1, 2, 7, 8)
    for make in (lambda: rt.RoPEAxial(layout="rotate"), lambda: rt.RoPEMixed(2, 8, layout="rotate"),
                 lambda: rt.RoPECat(layout="rotate"), lambda: rt.RoPEDinoV3(8, layout="rotate")):
        with pytest.raises(ValueError, match=r"\[rpe\.torch\] layout = 'rotate'; expected 'pairs' or 'half'"):
            make()
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope layout = 'interleaved'; expected 'pairs', 'half' or "
                                         r"'vjepa2' \(V-JEPA 2's own, for form 'vjepa2' only\)"):
        torch.ops.rpe.rope_forward(x, "axial", [100.0], None, 1, 2, 3, "interleaved")
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope layout = 'x'; expected 'pairs', 'half' or 'vjepa2'"):
        torch.ops.rpe.attention_forward(*G(x, x, x, [], [], [], "", "", "", "", "", "", [0.0] * 12, 2, 3, None, None,
                                        rope_form="axial", rope_params=[100.0], rope_skip=1, rope_layout="x"))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] suffix = -1; expected an int >= 0"):
        rt.RoPEAxial(suffix=-1)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope suffix = -2; expected >= 0"):
        torch.ops.rpe.rope_forward(x, "axial", [100.0], None, 1, 2, 3, "pairs", None, -2)
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] L = 7; expected rope skip \+ height\*width \+ suffix = 1 \+ 2\*3 \+ 1"):
        rt.RoPEAxial(skip=1, suffix=1)(x, 2, 3)
    m = rt.RoPEAxial(skip=1)
    # positions: shape, row count, dtype, values, type, device, and where they do not belong
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] positions has shape \(6, 3\); expected \(N, 2\) per-token"):
        m(x, positions=torch.zeros(6, 3))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] positions has shape \(12,\); expected \(N, 2\)"):
        m(x, positions=torch.zeros(12))
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] rope positions has shape \(5, 2\); expected \(6, 2\)"):
        m(x, positions=torch.zeros(5, 2))
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] positions has dtype torch\.bool; expected an integer, float32 "
                                        r"or float64 tensor"):
        m(x, positions=torch.zeros(6, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] positions has dtype torch\.float16"):
        m(x, positions=torch.zeros(6, 2, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] positions is a list; expected a torch\.Tensor"):
        m(x, positions=[[0, 0]] * 6)
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] rope positions\[1, 0\] = nan; expected finite"):
        m(x, positions=torch.tensor([[0.0, 0.0], [math.nan, 0.0]] + [[0.0, 0.0]] * 4))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] positions is on device meta; expected cpu, the device of the "
                                         r"other tensors"):
        m(x, positions=torch.zeros(6, 2, device="meta"))
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] positions has dtype torch\.bool; expected an integer, float32 or float64"):
        torch.ops.rpe.rope_forward(x, "axial", [100.0], None, 1, 1, 1, "pairs", torch.zeros(6, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] positions has shape \(6, 1\); expected \(N, 2\)"):
        torch.ops.rpe.rope_forward(x, "axial", [100.0], None, 1, 1, 1, "pairs", torch.zeros(6, 1))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] key_positions has shape \(6, 3\); expected \(N, 2\)"):
        rt.attention(x, x, x, rope=m, height=2, width=3, key_positions=torch.zeros(6, 3))
    with pytest.raises(ValueError, match=r"\[rpe\.attention\] rope key_positions has shape \(4, 2\); expected \(6, 2\)"):
        rt.attention(x, x, x, rope=m, height=2, width=3, key_positions=torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] positions / key_positions are given without rope"):
        rt.attention(x, x, x, height=2, width=3, positions=grid_positions(2, 3))
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] rope_key_positions has dtype torch\.complex64"):
        torch.ops.rpe.attention_forward(*G(x, x, x, [], [], [], "", "", "", "", "", "", [0.0] * 12, 2, 3, None, None,
                                        rope_form="axial", rope_params=[100.0], rope_skip=1,
                                        rope_key_positions=torch.zeros(6, 2, dtype=torch.complex64)))
    # DINOv3's configuration
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] dim = 6; expected a multiple of 4"):
        rt.RoPEDinoV3(6)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] min_period = 0\.5, max_period = None; give both or neither"):
        rt.RoPEDinoV3(8, min_period=0.5)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] normalize_coords = 'mean'; expected 'separate', 'max' or 'min'"):
        rt.RoPEDinoV3(8, normalize_coords="mean")
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] jitter_coords = 0\.5; expected None or a number >= 1"):
        rt.RoPEDinoV3(8, jitter_coords=0.5)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] shift\[1\] = nan; expected a finite number"):
        rt.RoPEDinoV3(8, shift=(0.0, math.nan))
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] rescale = 0; expected finite and > 0"):
        rt.RoPEDinoV3(8, rescale=0.0, skip=1)(x, 2, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] min_period, max_period = -1, 4; expected both finite and > 0"):
        rt.RoPEDinoV3(8, min_period=-1.0, max_period=4.0, skip=1)(x, 2, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope_params holds 8 values for form 'dinov3'; expected 9"):
        torch.ops.rpe.rope_forward(x, "dinov3", [100.0, 0, 0, 0, 0, 0, 1, 1], None, 1, 2, 3, "half")
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope normalize = 3; expected 0 \(separate\), 1 \(max\) or 2"):
        torch.ops.rpe.rope_forward(x, "dinov3", [100.0, 0, 0, 3, 0, 0, 1, 1, 1], None, 1, 2, 3, "half")
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] rope needs head_dim D = 6 to be a positive multiple of 4"):
        torch.ops.rpe.rope_forward(torch.randn(1, 2, 7, 6), "dinov3", [100.0, 0, 0, 0, 0, 0, 1, 1, 1], None, 1, 2, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the meta-device case above runs the same check)")
def test_rope_positions_on_another_device_are_refused():
    """RoPE positions go on the CPU or on x's device (the CUDA operators take them: test_cuda.py
    compares them with the CPU's); CUDA positions with CPU tensors are refused, naming the
    argument, before the dispatcher."""
    m = rt.RoPEAxial(skip=1)
    x, pos = torch.randn(1, 2, 7, 8), grid_positions(2, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] positions is on device cuda:0; expected cpu, the device of "
                                         r"the other tensors"):
        m(x, positions=pos.cuda())
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] positions is on device cuda:0; expected cpu"):
        rt.attention(x, x, x, rope=m, positions=pos.cuda())
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] key_positions is on device cuda:0; expected cpu"):
        rt.attention(x, x, x, rope=m, height=2, width=3, key_positions=pos.cuda())


def test_swin_errors():
    t = torch.zeros(2, 45)
    with pytest.raises(ValueError, match=r"\[rpe\.mapping\.swin\] grid = 4x5 is larger than the window 3x5"):
        torch.ops.rpe.term_forward(None, [t], "swin", "bias", "k", 3, 5, 0, 0, 4, 5)
    with pytest.raises(ValueError, match=r"\[rpe\.mapping\.beit\] window_h = 9000; expected \[1, 8192\]"):
        rt.RelPosBias((9000, 2), 2, kind="beit")
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] method = 'swin' with mode = contextual, target = k; expected "
                                         r"mode = bias on k"):
        torch.ops.rpe.term_forward(torch.zeros(1, 2, 15, 3), [torch.zeros(2, 3, 45)], "swin", "contextual", "k", 3, 5, 0,
                                   0, 3, 5)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] alpha = 2\.5 \(method 'swin', the window or grid rows\)"):
        torch.ops.rpe.term_forward(None, [t], "swin", "bias", "k", 2.5, 5, 0, 0, 2, 5)
    with pytest.raises(ValueError, match=r"\[rpe\.term\] table has shape \(2, 44\); expected \(2, 45\)"):
        torch.ops.rpe.term_forward(None, [torch.zeros(2, 44)], "swin", "bias", "k", 3, 5, 0, 0, 3, 5)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] timm_table has shape \(2, 3, 4\); expected \(K, H\)"):
        rt.table_from_timm(torch.zeros(2, 3, 4))
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] timm_table has dtype torch\.int64"):
        rt.table_from_timm(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] kind = 'vit'"):
        rt.RelPosBias(3, 2, kind="vit")
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] L = 10; expected skip \+ height\*width = 0 \+ 3\*3"):
        x = torch.zeros(1, 2, 10, 4)
        rt.attention(x, x, x, rpe_k=rt.RelPosBias(3, 2))


def test_swinv2_errors():
    with pytest.raises(ValueError, match=r"\[rpe\.log_coords\] window_h = 1 with pretrained_h = 0 divides by zero"):
        rt.relative_log_coords((1, 4))
    with pytest.raises(ValueError, match=r"\[rpe\.log_coords\] pretrained_h = 1, pretrained_w = 5; expected both 0"):
        rt.relative_log_coords((3, 5), (1, 5))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] mode = 'log'; expected swin or cr"):
        rt.relative_log_coords((3, 5), mode="log")
    with pytest.raises(ValueError, match=r"\[rpe\.cpb\] raw has shape \(44, 2\); expected \(45, 2\)"):
        rt.cpb_table(torch.zeros(44, 2), (3, 5))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] raw has shape \(45,\); expected \(K, H\)"):
        rt.cpb_bias(torch.zeros(45), (3, 5))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] window_size = \(3, 5, 1\)"):
        rt.cpb_bias(torch.zeros(45, 2), (3, 5, 1))


def test_sam_alibi_errors():
    q = torch.zeros(1, 2, 6, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rel_pos_w has shape \(5, 2\); expected C = 3 columns, the head_dim of q"):
        rt.decomposed_rel_pos(q, torch.zeros(3, 3), torch.zeros(5, 2), 2, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.vit\.decomposed\] height = 0; expected 1 <= height"):
        rt.decomposed_rel_pos(q, torch.zeros(3, 3), torch.zeros(5, 3), 0, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] length = 0; expected 1 <= length"):
        rt.resize_rel_pos(torch.zeros(3, 2), 0)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] height = 3, width = 2; this DecomposedRelPos is built for 2x3"):
        rt.attention(q, q, q, rpe_k=rt.DecomposedRelPos(2, 3, 3), height=3, width=2)
    with pytest.raises(ValueError, match=r"\[rpe\.vit\.alibi\] num_heads = 0; expected 1 <= num_heads <= 2\^20"):
        rt.ALiBi2D(0, 3, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.vit\.alibi\] height = 0; expected 1 <= height <= 23170"):
        rt.ALiBi2D(2, 0, 3)
    with pytest.raises(ValueError, match=r"\[rpe\.vit\.alibi\] num_heads = -1"):
        rt.alibi_slopes(-1)
    with pytest.raises(ValueError, match=r"\[rpe\.attention\] rpe_k table has shape \(4, 25\); expected \(2, 25\)"):
        rt.attention(q, q, q, rpe_k=rt.ALiBi2D(4, 2, 3))
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] rpe_k is a Linear"):
        rt.attention(q, q, q, rpe_k=torch.nn.Linear(2, 2))


def test_sam_alibi_terms_are_bounded_to_their_grid():
    """A decomposed / alibi term built for 3x5 refuses a taller or wider grid (the clip index would
    merge far offsets) and on a smaller grid gives the full grid's values at the same tokens."""
    table = rt.ALiBi2D(2, 3, 5).table  # (2, 81): built for 3x5
    for h, w in [(4, 5), (3, 6), (5, 3)]:
        with pytest.raises(ValueError, match=rf"\[rpe\.mapping\.within_grid\] grid = {h}x{w} is larger than the 3x5 grid "
                                             r"the term was built for"):
            torch.ops.rpe.term_forward(None, [table], "alibi", "bias", "k", 3, 5, 0, 0, h, w)
    x = torch.zeros(1, 2, 20, 4)
    with pytest.raises(ValueError, match=r"\[rpe\.mapping\.within_grid\] grid = 4x5"):
        rt.attention(x, x, x, rpe_k=rt.TermSlot("alibi", [table], (3, 5)), height=4, width=5)
    rows = torch.zeros(1, 4, 9)
    with pytest.raises(ValueError, match=r"\[rpe\.mapping\.within_grid\] grid = 3x6 is larger than the 3x5 grid"):
        torch.ops.rpe.term_forward(torch.zeros(1, 2, 18, 4), [rows, rows], "decomposed", "contextual", "k", 3, 5, 0, 0, 3, 6)
    # a 2x3 grid: the 3x5 bias at tokens (r, c) -> r*5 + c, which is -slope * distance
    big = rt.TermSlot("alibi", [table], (3, 5))()[0]  # (2, 15, 15)
    small = rt.TermSlot("alibi", [table], (3, 5))(height=2, width=3)[0]  # (2, 6, 6)
    tok = torch.tensor([r * 5 + c for r in range(2) for c in range(3)])
    assert torch.equal(small, big[:, tok][:, :, tok])
    rr, cc = torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij")
    dist = torch.cdist(torch.stack([rr.flatten(), cc.flatten()], 1).double(), torch.stack([rr.flatten(), cc.flatten()], 1).double())
    want = -torch.tensor(rt.alibi_slopes(2), dtype=F64)[:, None, None] * dist
    assert_close(small, want, 1e-6, 1e-6, "alibi bias on the smaller grid")
    # decomposed: the 2x3 term of q equals the 3x5 term's rows/cols at those tokens
    rel_h, rel_w = torch.randn(5, 4, dtype=F64), torch.randn(9, 4, dtype=F64)
    tables = torch.ops.rpe.decomposed_tables(rel_h, rel_w, 3, 5, 0, True)
    slot = rt.TermSlot("decomposed", list(tables), (3, 5))
    q_big = torch.randn(1, 2, 15, 4, dtype=F64)
    out_big = slot(q_big)
    out_small = slot(q_big[:, :, tok], height=2, width=3)
    # (the q·table products may round differently with L: equal to float64 rounding)
    assert_close(out_small, out_big[:, :, tok][:, :, :, tok], 1e-12, 1e-12, "decomposed term on the smaller grid")


def test_module_arguments_are_checked_with_named_errors():
    # found by a fresh-user review: these raised RuntimeError from torch or built silently
    cases = [
        (lambda: rt.RoPEMixed(-1, 8), ValueError, r"num_heads = -1"),
        (lambda: rt.RoPEMixed(0, 8), ValueError, r"num_heads = 0"),
        (lambda: rt.RoPEMixed(2, 7), ValueError, r"head_dim = 7; expected an even number"),
        (lambda: rt.RelPosBias((3, 3), -2), ValueError, r"num_heads = -2"),
        (lambda: rt.DecomposedRelPos(0, 4, 8), ValueError, r"height = 0"),
        (lambda: rt.DecomposedRelPos(4, -1, 8), ValueError, r"width = -1"),
        (lambda: rt.DecomposedRelPos(4, 4, 8, rel_pos_lengths=(0, 7)), ValueError, r"rel_pos_lengths\[0\] = 0"),
        (lambda: rt.resize_rel_pos(torch.zeros(5, 2), 2 ** 40), ValueError, r"length = 1099511627776"),
        (lambda: rt.ALiBi2D(1, 23171, 23171), ValueError, r"height = 23171"),
        (lambda: rt.ALiBi2D(2, 3, 3, dtype=torch.int32), TypeError, r"dtype = torch.int32; expected a floating-point"),
        (lambda: rt.TermSlot("swin", [], (3, 4)), TypeError, r"tables = \[\]"),
        (lambda: rt.TermSlot("swim", [torch.zeros(1, 35)], (3, 4)), ValueError, r"method = 'swim'"),
        (lambda: rt.TermSlot("swin", [torch.zeros(1, 35)], (3, 4))(None, 3, None), ValueError, r"give both or neither"),
        (lambda: rt.attention(*(torch.zeros(1, 1, 4, 0) for _ in range(3))), ValueError, r"expected D >= 1"),
        (lambda: rt.decomposed_rel_pos(torch.zeros(1, 1, 4, 8), torch.zeros(3, 6), torch.zeros(3, 6), 2, 2), ValueError,
         r"rel_pos_h has shape \(3, 6\); expected C = 8"),
    ]
    for make, error, pattern in cases:
        with pytest.raises(error, match=pattern) as info:
            make()
        assert "[rpe." in str(info.value), str(info.value)


@pytest.mark.parametrize("interleaved, sections, axes", [(0, [1, 2, 1], [0, 1, 1, 2]), (1, [2, 1, 1], [0, 1, 2, 0])])
def test_rope_mrope_by_name_on_the_grid(interleaved, sections, axes):
    # Qwen-VL's M-RoPE through the registry's form "mrope" (params theta, section_t, section_h,
    # section_w, interleaved): on a grid the ids are (0, row, col); pair j turns by
    # id_axis(j) * 1/theta^(2j/D) (float32), channels (j, j + D/2) (layout half)
    D, H, W, skip, theta = 8, 2, 3, 1, 100.0
    x = torch.randn(2, 2, skip + H * W, D, dtype=torch.float64)
    y = torch.ops.rpe.rope_forward(x, "mrope", [theta] + sections + [interleaved], None, skip, H, W, "half")
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    rows, cols = torch.arange(H).repeat_interleave(W), torch.arange(W).repeat(H)
    ids = torch.stack([torch.zeros_like(rows), rows, cols], 1).float()  # (N, 3)
    angle = (ids[:, axes] * inv).double()  # (N, D/2), float32 products
    c, s = angle.cos(), angle.sin()
    x1, x2 = x[..., skip:, : D // 2], x[..., skip:, D // 2:]
    expected = torch.cat([x[..., :skip, :], torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)], -2)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] mrope sections = 1,2,2 sum to 5 frequency pairs; expected D/2 = 4"):
        torch.ops.rpe.rope_forward(x, "mrope", [theta, 1, 2, 2, interleaved], None, skip, H, W, "half")
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope section_h = 1\.5; expected an integer"):
        torch.ops.rpe.rope_forward(x, "mrope", [theta, 1, 1.5, 1, interleaved], None, skip, H, W, "half")
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] rope_params holds 4 values for form 'mrope'; expected 5 \(theta, "
                                         r"section_t, section_h, section_w, interleaved\)"):
        torch.ops.rpe.rope_forward(x, "mrope", [theta, 1, 2, 1], None, skip, H, W, "half")


def test_rope_grid_sides_and_bases_are_checked_not_truncated():
    """Heights and widths are integers (a float is refused, not truncated by int()); numpy and
    torch integers are taken where Python ints are; a frequency base beyond float32's range is
    refused naming the value given (the library computes in float32)."""
    x = torch.randn(1, 2, 6, 8)
    ref = rt.RoPEAxial()(x, 2, 3)
    # numpy / torch integers give the same rotation as Python ints
    assert torch.equal(rt.RoPEAxial()(x, np.int64(2), torch.tensor(3)), ref)
    m = rt.RoPEVJEPA2(grid_size=np.int64(3), grid_depth=np.int32(1))
    assert m.grid_size == 3 and type(m.grid_size) is int
    assert torch.equal(rt.RoPEVJEPA2(grid_size=(np.int64(2), 3))(x), rt.RoPEVJEPA2(grid_size=(2, 3))(x))
    assert rt.RoPEMRoPE(sections=(np.int64(1), 1, 2)).sections == (1, 1, 2)
    cases = [
        (lambda: rt.RoPEAxial()(x, 2.0, 3), TypeError, r"\[rpe\.torch\] height = 2\.0; expected an int"),
        (lambda: rt.RoPEAxial()(x, 2, 3.9), TypeError, r"\[rpe\.torch\] width = 3\.9; expected an int"),
        (lambda: rt.RoPEVJEPA2()(torch.randn(1, 2, 6, 14), 2.5, 3), TypeError,
         r"\[rpe\.torch\] height = 2\.5; expected an int"),
        (lambda: rt.RoPEVJEPA2(grid_size=3.0), ValueError, r"\[rpe\.torch\] grid_size = 3\.0; expected an int or a pair"),
        (lambda: rt.RoPEVJEPA2(theta=1e300), ValueError,
         r"\[rpe\.torch\] theta = 1e\+300; expected \|theta\| <= 3\.4028235e\+38 \(the library computes in float32\)"),
        (lambda: rt.RoPEAxial(theta=1e300), ValueError, r"\[rpe\.torch\] theta = 1e\+300; expected \|theta\| <= 3\.4028235e\+38"),
        (lambda: rt.RoPEMRoPE(theta=-1e39), ValueError, r"\[rpe\.torch\] theta = -1e\+39; expected \|theta\| <= "),
        (lambda: rt.RoPECat(temperature=1e40), ValueError, r"\[rpe\.torch\] temperature = 1e\+40; expected "),
        (lambda: rt.RoPEMixed(2, 8, theta=1e39), ValueError, r"\[rpe\.torch\] theta = 1e\+39; expected "),
        (lambda: rt.RoPEAxial(theta="10"), ValueError, r"\[rpe\.torch\] theta = '10'; expected a number"),
        (lambda: rt.RoPEMRoPE(sections=(1.0, 1, 2)), ValueError, r"\[rpe\.torch\] sections = \(1\.0, 1, 2\); expected 3 ints"),
    ]
    for make, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            make()
    # the library's own checks of the base still name it (sign, finiteness)
    with pytest.raises(ValueError, match=r"\[rpe\.rope\] theta = -1; expected finite and > 0"):
        rt.RoPEAxial(theta=-1.0)(x, 2, 3)


def test_rope_mrope_module_in_attention_and_errors():
    """RoPEMRoPE at per-token (t, h, w) position ids (a text token, a 1x2x3 image, two text
    tokens, as get_rope_index numbers them) in rpe_torch.attention equals the attention over the
    module's own rotations of q and k, gradients included (float64); the grid gives ids
    (0, row, col); the errors name the argument."""
    torch.manual_seed(3)
    m = rt.RoPEMRoPE((1, 2, 1), theta=100.0, skip=1, suffix=1)
    pos = torch.tensor([[1, 1, 1], [2, 2, 2], [2, 2, 3], [2, 2, 4], [2, 3, 2], [2, 3, 3], [2, 3, 4], [5, 5, 5]])
    L = 1 + pos.shape[0] + 1
    q, k, v = (torch.randn(2, 2, L, 8, dtype=F64, requires_grad=True) for _ in range(3))
    out = rt.attention(q, k, v, rope=m, positions=pos)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    qr, kr = m(q, positions=pos), m(k, positions=pos)
    assert torch.equal(qr[:, :, :1], q[:, :, :1]) and torch.equal(qr[:, :, -1:], q[:, :, -1:])  # skip, suffix
    ref = torch.softmax(qr @ kr.transpose(-1, -2) * 8 ** -0.5, -1) @ v
    assert_close(out, ref.detach().numpy(), 1e-12, 1e-10, "out")
    for got, want, name in zip(grads, torch.autograd.grad(ref, (q, k, v), g), ("grad_q", "grad_k", "grad_v")):
        assert_close(got, want.numpy(), 1e-11, 1e-9, name)
    # the grid: ids (0, row, col), the same as those positions given explicitly
    x = torch.randn(1, 2, 1 + 6 + 1, 8, dtype=F64)
    grid_ids = torch.tensor([[0, r, c] for r in range(2) for c in range(3)])
    assert torch.equal(m(x, 2, 3), m(x, positions=grid_ids))
    assert "sections=(1, 2, 1)" in repr(m) and "suffix=1" in repr(m)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] sections = \(1, 2\); expected 3 ints >= 0"):
        rt.RoPEMRoPE((1, 2))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] positions has shape \(8, 2\); expected \(N, 3\) per-token "
                                         r"\(t, h, w\)"):
        m(q, positions=pos[:, 1:])
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] positions has shape \(8, 2\); expected \(N, 3\)"):
        rt.attention(q, k, v, rope=m, positions=pos[:, 1:])
    with pytest.raises(ValueError, match=r"mrope sections = 1,2,1 sum to 4 frequency pairs; expected D/2 = 8"):
        m(torch.randn(1, 1, L, 16, dtype=F64), positions=pos)


def vjepa2_cases():
    return [c for c in rope_cases() if c.name.startswith("vjepa2_")]


def vjepa2_by_hand(x, pos, skip=0, suffix=0, theta=10000.0):
    """transformers' rotate_queries_or_keys on the three slices of 2*((D//3)//2) channels, the rest
    passed through (apply_rotary_embeddings), written out here at the float64 x with rpe's float32
    angles: x (B, H, L, D), pos (N, 3) (frame, row, col) of tokens skip .. L − suffix."""
    D = x.shape[-1]
    s = 2 * ((D // 3) // 2)
    m = s // 2
    omega = 1.0 / torch.tensor(theta, dtype=torch.float32) ** (torch.arange(m, dtype=torch.float32) / m)
    end = x.shape[2] - suffix
    mid = x[:, :, skip:end]
    parts = []
    for a in range(3):
        angle = (pos[:, a:a + 1].float() * omega).double()  # (N, m)
        c, sn = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)  # tiled twice over the slice
        xs = mid[..., a * s:(a + 1) * s]
        y1, y2 = xs.unflatten(-1, (-1, 2)).unbind(-1)
        rot = torch.stack((-y2, y1), -1).flatten(-2)  # adjacent pairs
        parts.append(xs * c + rot * sn)
    parts.append(mid[..., 3 * s:])
    return torch.cat([x[:, :, :skip], torch.cat(parts, -1), x[:, :, end:]], 2)


@pytest.mark.parametrize("case", vjepa2_cases(), ids=lambda p: p.name)
def test_rope_vjepa2_golden_clip_and_position_ids(case):
    """The V-JEPA 2 golden cases through the clip instead of the ids: get_position_ids gives the
    case's (frame, row, col) ids (every token, or the mask's kept ones); a whole clip rotated from
    grid_depth × grid_size (or frames and a square inferred from L) equals the case's y and
    grad_x, and equals the rotation at the ids exactly."""
    meta = json.loads((case / "meta.json").read_text())
    m = rope_module(meta)
    kept = meta["kept"]
    ids = m.get_position_ids(None if kept is None else torch.tensor(kept))
    assert ids.dtype == torch.int64 and torch.equal(ids.float(), npy(case / "positions.npy"))
    if kept is not None:
        return
    x = npy(case / "x.npy").requires_grad_()
    y = m(x)
    assert_close(y, np.load(case / "y.npy"), 2e-5, 2e-5, "y")
    assert torch.equal(y, m(x, positions=ids))
    y.backward(npy(case / "grad_y.npy"))
    assert_close(x.grad, np.load(case / "grad_x.npy"), 2e-5, 2e-5, "grad_x")
    frames, rows, cols = meta["grid_thw"]
    bare = rt.RoPEVJEPA2()  # no grid: frames given, the frame's square side inferred from L
    assert torch.equal(bare(x.detach(), frames=frames), y.detach())
    assert torch.equal(bare(x.detach(), rows, cols, frames=frames), y.detach())


def test_rope_vjepa2_by_hand_and_not_a_rotation():
    """D = 14: three slices of 4 channels (2 frequencies each), 2 passed through; class token and
    a suffix token unrotated; the source's map written out (vjepa2_by_hand) at float32 angles; the
    two channels of a partnership turn by different angles, so the map does not keep norms, and
    its backward is its transpose (<y, g> = <x, grad_x>)."""
    torch.manual_seed(5)
    m = rt.RoPEVJEPA2(theta=100.0, grid_depth=2, grid_size=(2, 3), head_dim=14, skip=1, suffix=1)
    x = torch.randn(2, 3, 1 + 12 + 1, 14, dtype=F64, requires_grad=True)
    y = m(x)
    ids = m.get_position_ids()
    assert ids.tolist()[:4] == [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0]] and ids.tolist()[6] == [1, 0, 0]
    want = vjepa2_by_hand(x.detach(), ids, 1, 1, 100.0)
    assert_close(y, want.numpy(), 1e-12, 1e-10, "y")
    assert torch.equal(y[:, :, 0], x[:, :, 0]) and torch.equal(y[:, :, -1], x[:, :, -1])
    assert torch.equal(y[..., 12:], x[..., 12:])  # the passed-through channels
    assert not torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-6)  # not a rotation (the source's map)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    assert abs(float(((y * g).sum() - (x * gx).sum()).detach())) < 1e-10
    # the first frame alone: the operators' grid (ids (0, row, col)), as the clip of one frame
    one = rt.RoPEVJEPA2(theta=100.0, skip=1, suffix=1)
    x1 = x.detach()[:, :, :1 + 6 + 1]
    assert torch.equal(one(x1, 2, 3), one(x1, positions=ids[:6]))
    assert_close(one(x1, 2, 3), vjepa2_by_hand(x1, ids[:6], 1, 1, 100.0).numpy(), 1e-12, 1e-10, "one frame")
    assert "grid_depth=2, grid_size=(2, 3), head_dim=14, skip=1, suffix=1" in repr(m)
    assert (m.d_dim, m.h_dim, m.w_dim, m.attention_head_size) == (4, 4, 4, 14)
    assert not list(m.parameters()) and not list(m.buffers())
    # from transformers' VJEPA2RopeAttention (its attribute names; ViT-H: 16 heads of 80)
    hf = type("VJEPA2RopeAttention", (), {"grid_depth": 8, "grid_size": 16, "attention_head_size": 80})()
    t = rt.RoPEVJEPA2.from_transformers(hf, skip=1)
    assert (t.theta, t.grid_depth, t.grid_size, t.d_dim, t.skip) == (10000.0, 8, 16, 26, 1)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] module \(object\) has no attribute 'grid_depth'"):
        rt.RoPEVJEPA2.from_transformers(object())


@pytest.mark.parametrize("where", ["clip", "mask_and_keys", "one_frame"])
def test_rope_vjepa2_in_attention_equals_composed(where):
    """rpe_torch.attention(rope=RoPEVJEPA2) equals the plain attention over the module's own maps
    of q and k, output and the q, k, v gradients, float64: a 2-frame clip (grid_depth, the
    attention's height and width) with a class and a suffix token; a mask's kept tokens for the
    queries with the keys at other real ids; one frame (the operators' grid)."""
    torch.manual_seed(7)
    D = 20  # slices of 6 (3 frequencies), 2 channels passed through
    if where == "clip":
        m, grid, pos, key_pos = rt.RoPEVJEPA2(grid_depth=2, skip=1, suffix=1), (2, 3), None, None
        L = 1 + 12 + 1
    elif where == "mask_and_keys":
        m, grid = rt.RoPEVJEPA2(grid_depth=3, grid_size=3), (None, None)
        pos = m.get_position_ids(torch.tensor([0, 4, 5, 9, 13, 17, 22, 26]))
        key_pos = pos.to(F64) * 0.75 + torch.tensor([0.5, -1.0, 0.25], dtype=F64)
        L = pos.shape[0]
    else:
        m, grid, pos, key_pos = rt.RoPEVJEPA2(theta=1000.0, skip=2), (3, 3), None, None
        L = 2 + 9
    q, k, v = (torch.randn(2, 2, L, D, dtype=F64, requires_grad=True) for _ in range(3))
    out = rt.attention(q, k, v, rope=m, height=grid[0], width=grid[1], positions=pos, key_positions=key_pos)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    qr = m(q, *grid, positions=pos)
    kr = m(k, *grid, positions=key_pos if key_pos is not None else pos)
    ref = torch.softmax(qr @ kr.transpose(-1, -2) * D ** -0.5, -1) @ v
    assert_close(out, ref.detach().numpy(), 1e-12, 1e-10, "out")
    for got, want, name in zip(grads, torch.autograd.grad(ref, (q, k, v), g), ("grad_q", "grad_k", "grad_v")):
        assert_close(got, want.numpy(), 1e-11, 1e-9, name)
    if where == "clip":  # the module's clip is the tokens' ids, by hand
        assert_close(qr, vjepa2_by_hand(q.detach(), rt.RoPEVJEPA2(grid_depth=2, grid_size=(2, 3)).get_position_ids(), 1,
                                        1).numpy(), 1e-12, 1e-10, "q rotated")
    f = Wrap(rope=m, grid=grid, positions=pos, key_positions=key_pos)
    assert gradcheck(lambda *a: f(*a), tuple(t.detach()[:1].requires_grad_() for t in (q, k, v)))


def test_rope_vjepa2_errors_name_the_argument():
    x = torch.randn(1, 2, 8, 14)
    m = rt.RoPEVJEPA2(grid_depth=2, grid_size=2)
    pos = m.get_position_ids()
    cases = [
        # positions: (N, 3) (frame, row, col), from the module and the attention
        (lambda: m(x, positions=pos[:, 1:]), ValueError,
         r"\[rpe\.torch\] positions has shape \(8, 2\); expected \(N, 3\) per-token \(frame, row, col\) coordinates"),
        (lambda: rt.attention(x, x, x, rope=m, positions=pos[:, 1:]), ValueError,
         r"\[rpe\.torch\] positions has shape \(8, 2\); expected \(N, 3\) per-token \(frame, row, col\)"),
        (lambda: rt.attention(x, x, x, rope=m, key_positions=pos[:, :2]), ValueError,
         r"\[rpe\.torch\] key_positions has shape \(8, 2\); expected \(N, 3\) per-token \(frame, row, col\)"),
        (lambda: m(x, positions=pos[:7]), ValueError, r"\[rpe\.rope\] rope positions has shape \(7, 3\); expected \(8, 3\)"),
        (lambda: torch.ops.rpe.rope_forward(x, "vjepa2", [10000.0], None, 0, 1, 1, "vjepa2", pos[:, :2]), ValueError,
         r"\[rpe\.rope\] rope positions has shape \(8, 2\); expected 3 axes .*, shape \(8, 3\)"),
        # head dims the form cannot take: the module's head_dim, then D of x (the library's messages)
        (lambda: rt.RoPEVJEPA2(head_dim=4), ValueError, r"\[rpe\.torch\] head_dim = 4; expected an even number >= 6"),
        (lambda: rt.RoPEVJEPA2(head_dim=15), ValueError, r"\[rpe\.torch\] head_dim = 15; expected an even number >= 6"),
        (lambda: rt.RoPEVJEPA2(head_dim=16)(x, 2, 2, frames=2), ValueError,
         r"\[rpe\.torch\] x has shape \(1, 2, 8, 14\); expected D = head_dim = 16"),
        # the attention too: a module built for one head_dim never runs on another D's slices
        (lambda: rt.attention(x, x, x, rope=rt.RoPEVJEPA2(grid_depth=2, grid_size=2, head_dim=16)), ValueError,
         r"\[rpe\.torch\] q has shape \(1, 2, 8, 14\); expected D = head_dim = 16"),
        (lambda: m(torch.randn(1, 2, 8, 4)), ValueError,
         r"\[rpe\.rope\] vjepa2 head_dim D = 4 gives slices of 0 channels \(2\*\(\(D/3\)/2\)\); expected D >= 6"),
        (lambda: m(torch.randn(1, 2, 8, 7)), ValueError, r"\[rpe\.rope\] rope needs head_dim D = 7 to be a positive "
                                                           r"multiple of 2"),
        (lambda: rt.attention(*(torch.randn(1, 2, 8, 4),) * 3, rope=m), ValueError,
         r"\[rpe\.rope\] vjepa2 head_dim D = 4 gives slices of 0 channels"),  # the policy's own component
        # the layout: vjepa2's own, and only for it
        (lambda: rt.RoPEVJEPA2(layout="half"), ValueError, r"\[rpe\.torch\] layout = 'half'; expected 'vjepa2'"),
        (lambda: rt.RoPEAxial(layout="vjepa2"), ValueError, r"\[rpe\.torch\] layout = 'vjepa2'; expected 'pairs' or 'half'"),
        (lambda: torch.ops.rpe.rope_forward(x, "vjepa2", [10000.0], None, 0, 2, 4, "pairs"), ValueError,
         r"\[rpe\.rope\] rope layout = pairs for a form that runs in its own layout; expected rope::layout::vjepa2"),
        (lambda: torch.ops.rpe.rope_forward(x, "axial", [100.0], None, 0, 2, 4, "vjepa2"), ValueError,
         r"\[rpe\.rope\] rope layout = vjepa2 for a form other than rope::vjepa2; expected pairs or half"),
        (lambda: torch.ops.rpe.attention_forward(*G(x, x, x, [], [], [], "", "", "", "", "", "", [0.0] * 12, 2, 4, None, None,
                                                 rope_form="vjepa2", rope_params=[10000.0], rope_layout="half")), ValueError,
         r"\[rpe\.attention\] rope layout = half for a form that runs in its own layout"),
        (lambda: torch.ops.rpe.rope_forward(x, "vjepa2", [], None, 0, 2, 4, "vjepa2"), ValueError,
         r"\[rpe\.torch\] rope_params holds 0 values for form 'vjepa2'; expected 1 \(theta\)"),
        # the clip against L, its sides, the parameters
        (lambda: m(torch.randn(1, 2, 9, 14)), ValueError,
         r"\[rpe\.torch\] L = 9; expected skip \+ frames\*height\*width \+ suffix = 0 \+ 2\*2\*2 \+ 0"),
        (lambda: rt.RoPEVJEPA2(grid_depth=2)(torch.randn(1, 2, 10, 14)), ValueError,
         r"\[rpe\.torch\] L = 10 is not skip \+ frames\*side\*side \+ suffix \(skip = 0, frames = 2, suffix = 0\)"),
        (lambda: rt.RoPEVJEPA2()(x, 2, None), ValueError, r"\[rpe\.torch\] height = 2, width = None; give both or neither"),
        (lambda: rt.RoPEVJEPA2()(x, 2, 2, frames=0), ValueError, r"\[rpe\.torch\] frames = 0; expected 1 <= frames"),
        (lambda: rt.RoPEVJEPA2(grid_depth=0), ValueError, r"\[rpe\.torch\] grid_depth = 0; expected 1 <= grid_depth"),
        (lambda: rt.RoPEVJEPA2(grid_size=(2, 0)), ValueError, r"\[rpe\.torch\] grid_size cols = 0"),
        (lambda: rt.RoPEVJEPA2(grid_size="4"), ValueError, r"\[rpe\.torch\] grid_size = '4'; expected an int or a pair"),
        (lambda: rt.RoPEVJEPA2(theta=math.inf), ValueError, r"\[rpe\.torch\] theta = inf; expected a finite number"),
        (lambda: rt.RoPEVJEPA2(theta=0.0, grid_depth=2)(x), ValueError, r"\[rpe\.rope\] theta = 0; expected finite and > 0"),
        (lambda: rt.RoPEVJEPA2().get_position_ids(), ValueError, r"\[rpe\.torch\] grid_size = None; expected the frame's"),
        (lambda: m.get_position_ids(torch.tensor([0, 8])), ValueError,
         r"\[rpe\.torch\] masks holds indices in \[0, 8\]; expected 0 <= index < 8"),
        (lambda: m.get_position_ids(torch.tensor([[0, 1]])), ValueError,
         r"\[rpe\.torch\] masks is a torch\.int64 tensor of shape \(1, 2\); expected an integer tensor \(N,\) of kept "
         r"token indices"),
        (lambda: m.get_position_ids(torch.tensor([0.5, 3.0])), ValueError,  # the dtype is what is wrong, and named
         r"\[rpe\.torch\] masks is a torch\.float32 tensor of shape \(2,\); expected an integer tensor"),
    ]
    for make, error, pattern in cases:
        with pytest.raises(error, match=pattern) as info:
            make()
        assert "[rpe." in str(info.value), str(info.value)
