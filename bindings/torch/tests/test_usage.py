"""rpe_torch as a PyTorch user meets it: bad input on the public functions raises a Python
exception naming the argument (device, mixed devices, dtype, meta tensors, sizes beyond int32,
a grid whose skip tokens disagree with the configuration, a per-head table for another head
count); models pickle with torch.save and trace with torch.jit.trace; CPU autocast (bf16) runs
the bf16 kernels and returns bf16 within the documented tolerance of float64."""
import io
import os

import pytest
import torch

import rpe_torch
from conftest import attention_operators
from digits_model import build, images

F64 = torch.float64


def qkv(B=2, H=2, L=7, D=4, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def modules(rpe_on="qkv", skip=1, shared=True, heads=2, D=4, mode="ctx", dtype=F64):
    cfg = rpe_torch.get_rpe_config(ratio=1.0, method="product", mode=mode, shared_head=shared, skip=skip,
                                   rpe_on=rpe_on)
    mods = rpe_torch.build_rpe(cfg, head_dim=D, num_heads=heads)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in mods:
            if m is not None:
                for p in m.parameters():
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return [m.to(dtype) if m is not None else None for m in mods]


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------

def test_a_grid_with_more_skip_tokens_than_configured_is_refused():
    # L = 197 = 2 + 13*15 with a skip-1 configuration: refused (it used to run with skip = 2)
    q, k, v = qkv(B=1, H=2, L=197, D=4)
    mods = modules(skip=1)
    with pytest.raises(ValueError, match=r"L = 197 = skip 2 \+ 13\*15, but the term was configured with skip = 1"):
        rpe_torch.attention(q, k, v, *mods, height=13, width=15)
    with pytest.raises(ValueError, match=r"configured with skip = 1"):
        mods[1](q, 13, 15)
    out = rpe_torch.attention(q, k, v, *mods, height=14, width=14)  # 1 + 14*14: the configured skip
    assert out.shape == q.shape


def test_a_per_head_table_for_other_heads_is_refused():
    q, k, v = qkv(H=6)
    for mode in ("ctx", "bias"):
        mods = modules(rpe_on="k", shared=False, heads=4, mode=mode)  # tables for 4 heads
        with pytest.raises(ValueError, match=r"table"):
            rpe_torch.attention(q, k, v, *mods, height=2, width=3)
    for mode in ("ctx", "bias"):
        mods = modules(rpe_on="k", shared=False, heads=4, mode=mode)
        with pytest.raises(ValueError, match=r"table.* has shape \(4, "):
            mods[1](q, 2, 3)  # the module alone (bias mode used to return a (1, 4, L, L) bias for 6 heads)
    for m in (rpe_torch.RelPosBias((2, 3), 4).double(), rpe_torch.ALiBi2D(4, 2, 3, dtype=F64)):
        with pytest.raises(ValueError, match=r"rpe_k table has shape \(4, \d+\); expected \(6, "):
            rpe_torch.attention(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:], rpe_k=m)


def test_device_dtype_meta_and_size_errors_name_the_argument():
    q, k, v = qkv()
    mods = modules()
    with pytest.raises(ValueError, match=r"\[rpe.torch\] k is on device meta; expected cpu"):
        rpe_torch.attention(q, k.detach().to("meta"), v, *mods, height=2, width=3)
    with pytest.raises(ValueError, match=r"\[rpe.torch\] x is on device meta"):
        mods[1](q.detach().to("meta"), 2, 3)
    with pytest.raises(ValueError, match=r"rope freqs is on device meta"):
        rpe_torch.attention(q, k, v, height=2, width=3, rope=rpe_torch.RoPEMixed(2, 4, skip=1).double().to("meta"))
    with pytest.raises(TypeError, match=r"\[rpe.torch\] v has dtype torch\.int64 but q has torch\.float64; q, k, v, the tables"):
        rpe_torch.attention(q, k, v.detach().long(), *mods, height=2, width=3)
    with pytest.raises(TypeError, match=r"\[rpe.torch\] q has dtype torch\.int32; expected float32, float64, bfloat16 or float16"):
        rpe_torch.attention(q.detach().int(), k, v, *mods, height=2, width=3)
    with pytest.raises(TypeError, match=r"\[rpe.torch\] x has dtype torch\.int32"):
        rpe_torch.RoPEAxial(skip=1)(q.detach().int(), 2, 3)
    with pytest.raises(TypeError, match=r"q is a list"):
        rpe_torch.attention([1.0], k, v)
    # an expanded view larger than int32 allows: refused before anything is copied
    huge = torch.zeros(1, 1, 1, 1, dtype=F64).expand(1, 1, 1, 2**31)
    with pytest.raises(ValueError, match=r"\[rpe.torch\] x has shape \(1, 1, 1, 2147483648\); expected every "
                                         r"dimension <= 2147483647"):
        rpe_torch.term(huge, [torch.zeros(1, 4, 26, dtype=F64)], "product", "contextual", "k", 1.0, 2.0, 8.0, 0, 1, 1)
    with pytest.raises(ValueError, match=r"\[rpe.torch\] q has shape .*2147483648"):
        rpe_torch.attention(huge, huge, huge, height=1, width=1)


def test_integer_tensors_cannot_require_grad_and_bool_masks_are_not_differentiated():
    with pytest.raises(RuntimeError, match="floating point"):
        torch.zeros(2, dtype=torch.long).requires_grad_()
    q, k, v = qkv()
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    out = rpe_torch.attention(q, k, v, *modules(), height=2, width=3, key_padding_mask=kpm)
    out.sum().backward()
    assert q.grad is not None and kpm.grad is None


# ---------------------------------------------------------------------------------------------
# Saving, tracing
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused"])
def test_torch_save_and_load_the_whole_model(fused):
    model, _ = build(rpe_torch, "b", fused)
    x, _ = images()
    x = x[:4]
    with torch.no_grad():
        expected = model.eval()(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)


@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused"])
def test_jit_trace(fused):
    model, _ = build(rpe_torch, "b", fused)
    x, _ = images()
    model.eval()
    with torch.no_grad():
        traced = torch.jit.trace(model, x[:2])
        assert torch.equal(traced(x[2:6]), model(x[2:6]))
    kinds = {n.kind() for n in traced.inlined_graph.nodes()}
    assert any(kind.startswith("rpe::") for kind in kinds), kinds
    assert "rpe::num_buckets" not in kinds


@pytest.mark.parametrize("make", [lambda: rpe_torch.RelPosBias(3, 2), lambda: rpe_torch.ALiBi2D(2, 3, 3),
                                  lambda: rpe_torch.DecomposedRelPos(3, 3, 8)],
                         ids=["RelPosBias", "ALiBi2D", "DecomposedRelPos"])
def test_jit_trace_vit_term_modules(make):
    """The ViT term modules build a TermSlot per call through string-valued registry operators:
    torch.jit.trace records their results as constants, not the operators (whose str outputs a
    traced graph cannot hold), and the traced model gives eager's output on new inputs."""
    torch.manual_seed(3)
    term = make()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.term = term

        def forward(self, q):
            return rpe_torch.attention(q, q, q, rpe_k=self.term, height=3, width=3)

    model = Block()
    with torch.no_grad():
        traced = torch.jit.trace(model, torch.randn(1, 2, 9, 8))
        x = torch.randn(2, 2, 9, 8)
        assert torch.equal(traced(x), model(x))
    kinds = {n.kind() for n in traced.inlined_graph.nodes()}
    assert any(kind.startswith("rpe::") for kind in kinds), kinds
    assert not {"rpe::families", "rpe::slot_spec", "rpe::family_mode"} & kinds, kinds


@pytest.mark.parametrize("rpe_on", [None, "k", "q", "v", "qkv"])
def test_save_attn_none_keeps_probabilities_on_the_cpu_whatever_the_terms(monkeypatch, rpe_on):
    """save_attn=None in grad mode on the CPU keeps the probabilities (attention_forward_attn)
    whatever the terms (they take far less than 64 MiB here); True and False are obeyed; both give
    the same gradients."""
    mods = modules(rpe_on=rpe_on, mode="ctx") if rpe_on else [None, None, None]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 7, 4, generator=g, dtype=F64, requires_grad=True) for _ in range(3))
    grid = dict(height=2, width=3) if rpe_on else {}
    grads, out = {}, {}
    for save in (None, True, False):
        called = attention_operators(
            monkeypatch, lambda save=save: out.update(o=rpe_torch.attention(q, k, v, *mods, save_attn=save, **grid)))
        assert called == ["attention_forward" if save is False else "attention_forward_attn"], save
        grads[save] = torch.autograd.grad((out["o"] * out["o"]).sum(), (q, k, v))
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("value", ["no", 0, 1.0, torch.tensor(True)])
def test_save_attn_must_be_none_or_a_bool(value):
    """save_attn takes None, True or False: anything else is a TypeError naming it (a string such as
    "no" would otherwise count as True and keep the probabilities)."""
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"\[rpe.torch\] save_attn = .* has type .*; expected None, True or False"):
        rpe_torch.attention(q, k, v, save_attn=value)


def test_saved_probabilities_get_no_materialised_gradient():
    """The backward of attention_forward_attn gets no (B, H, L, L) tensor of zeros for the
    probabilities' gradient (they are not differentiable; autograd would otherwise allocate and
    fill one at every backward): no operator of the backward makes or fills a tensor of the
    probabilities' shape (1, 2, 9, 9), and the gradients equal the recomputing backward's."""
    q, k, v = qkv(B=1, H=2, L=9, D=4)
    mods = modules(rpe_on="k")
    grid = dict(height=2, width=4)
    out = rpe_torch.attention(q, k, v, *mods, save_attn=True, **grid)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        got = torch.autograd.grad(out.sum(), (q, k, v))
    events = prof.events()
    assert "rpe::attention_backward" in {e.name for e in events}
    # (zeros / zeros_like / ones_like fill through these; the sum's own gradient is a 0-d tensor)
    filled = [e.name for e in events if e.name in ("aten::fill_", "aten::zero_") and e.input_shapes[:1] == [[1, 2, 9, 9]]]
    assert not filled, filled
    want = torch.autograd.grad(rpe_torch.attention(q, k, v, *mods, save_attn=False, **grid).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("save_attn", [None, True, False], ids=["save_attn_None", "save_attn_True", "save_attn_False"])
def test_jit_trace_with_grad_enabled_checks_and_matches_eager(save_attn):
    """A trace made with grad enabled passes check_trace (which re-traces under no_grad: the
    operator must not depend on the grad mode; under the tracer save_attn=None is decided by the
    shapes only, as eager decides it in grad mode) and gives eager's output and gradients on new
    inputs, bit for bit, and eager's output under no_grad."""
    torch.manual_seed(5)
    mods = modules(rpe_on="qkv", skip=1, heads=2, D=4, mode="ctx", dtype=torch.float32)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(4, 12)
            self.rq, self.rk, self.rv = mods

        def forward(self, x):  # x: (B, H, L, 4)
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return rpe_torch.attention(q, k, v, self.rq, self.rk, self.rv, height=2, width=3, save_attn=save_attn)

    model = Block()
    x0, x1 = torch.randn(1, 2, 7, 4), torch.randn(2, 2, 7, 4)
    traced = torch.jit.trace(model, x0, check_inputs=[(x1,)])  # check_trace=True (the default)
    kinds = {n.kind() for n in traced.inlined_graph.nodes()}
    keeps = save_attn is not False  # None: 1·2·7·7 float32 probabilities, far below 64 MiB
    assert ("rpe::attention_forward_attn" in kinds) == keeps, kinds
    assert ("rpe::attention_forward" in kinds) == (not keeps), kinds
    w = torch.randn(2, 2, 7, 4)
    out_e, out_t = model(x1), traced(x1)
    assert torch.equal(out_t, out_e)
    grads_e = torch.autograd.grad((out_e * w).sum(), list(model.parameters()))
    grads_t = torch.autograd.grad((out_t * w).sum(), list(model.parameters()))
    for (name, _), ge, gt in zip(model.named_parameters(), grads_e, grads_t):
        assert torch.equal(gt, ge), name
    with torch.no_grad():  # the same graph runs in inference
        assert torch.equal(traced(x1), out_e)
    # under no_grad, save_attn=None traces the same operator (the shapes decide), as check_trace wants
    with torch.no_grad():
        kinds = {n.kind() for n in torch.jit.trace(model, x0).inlined_graph.nodes()}
    assert ("rpe::attention_forward_attn" in kinds) == keeps, kinds


# ---------------------------------------------------------------------------------------------
# Autocast
# ---------------------------------------------------------------------------------------------

def test_cpu_autocast_bf16_through_the_operators():
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in qkv(L=7))
    mods = modules(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = rpe_torch.attention(q, k, v, *mods, height=2, width=3)
        term = mods[1](q, 2, 3)
        rot = rpe_torch.RoPEAxial(skip=1)(q, 2, 3)
    assert out.dtype == term.dtype == rot.dtype == torch.bfloat16
    # against float64 on the same bf16 q, k, v and the unrounded tables: the bf16 kernels on the tables
    # autocast rounded to bf16, each output rounded once
    mods64 = [m.double() for m in modules()]
    ref = rpe_torch.attention(q.double(), k.double(), v.double(), *mods64, height=2, width=3)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(term.double(), mods64[1](q.double(), 2, 3), atol=2e-2, rtol=1e-2)
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad.float()).all()
    assert mods[1].lookup_table_weight.grad.dtype == torch.float32
    # float64 inputs are left alone by autocast (as PyTorch's own ops)
    q64, k64, v64 = qkv()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert rpe_torch.attention(q64, k64, v64, *mods64, height=2, width=3).dtype == F64


# ---------------------------------------------------------------------------------------------
# A long-lived process: the caches stay within their budget
# ---------------------------------------------------------------------------------------------
def _resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") / 2**20)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_many_grids_keep_the_caches_within_their_budget():
    # the reproducer: attention with iRPE-K (B = H = 1, D = 16) on many distinct grids
    # between 20x20 and 60x60; a 16 MiB budget holds a few of their (L, L) id tables
    _, rpe_k, _ = modules(rpe_on="k", heads=1, D=16, dtype=torch.float32)
    rpe_torch.clear_caches()
    rpe_torch.set_cache_budget(16 << 20)
    try:
        grids = [(h, w) for h in range(20, 61, 3) for w in range(20, 61, 4)]  # 154 distinct grids
        with torch.no_grad():
            for i, (h, w) in enumerate(grids):
                if i == 30:
                    start = _resident_mib()
                q = torch.randn(1, 1, 1 + h * w, 16)
                rpe_torch.attention(q, q, q, rpe_k=rpe_k, height=h, width=w)
        growth = _resident_mib() - start
        s = rpe_torch.cache_stats()["bucket_ids"]
        assert s["budget"] == 16 << 20
        assert s["bytes"] <= s["budget"]
        assert s["misses"] == len(grids)
        assert s["evictions"] >= len(grids) - 20
        assert growth < 96, f"resident memory grew by {growth:.0f} MiB over {len(grids) - 30} new grids"
        # an evicted grid is built again with the same values
        q = torch.randn(1, 1, 1 + 20 * 20, 16, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            a = rpe_torch.attention(q, q, q, rpe_k=rpe_k, height=20, width=20)
            rpe_torch.clear_caches()
            b = rpe_torch.attention(q, q, q, rpe_k=rpe_k, height=20, width=20)
        assert torch.equal(a, b)
    finally:
        rpe_torch.set_cache_budget(64 << 20)
        rpe_torch.clear_caches()


def test_cache_budget_arguments_are_checked():
    with pytest.raises(ValueError, match="nbytes = -1"):
        rpe_torch.set_cache_budget(-1)
    with pytest.raises(TypeError, match="nbytes must be an int"):
        rpe_torch.set_cache_budget(1.5)
