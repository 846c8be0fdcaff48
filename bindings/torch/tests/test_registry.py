"""rpe's registry of term families from Python: the names come from the C++ library
(torch.ops.rpe.families), a spec text works as a method, and a user's own mapping registered in a
plugin (examples/01_custom_mapping/manhattan.cpp, RPE_EXAMPLE_MANHATTAN) is reached by name after
torch.ops.load_library."""
import os

import pytest
import torch

import rpe_torch as rt

PLUGIN = os.environ.get("RPE_EXAMPLE_MANHATTAN", "")
CLASH = os.environ.get("RPE_TEST_CLASH_PLUGIN", "")  # tests/plugins/clash.cpp: registers "euc", a name taken

# |dr| + |dc| from the centre of a 5x5 grid through the piecewise index of ratio 1.9:
# distances 0, 1, 2, 3, 4 -> ids 0, 1, 2, 2, 3 (g(3) = round(2.32), g(4) = round(2.58))
MANHATTAN_5X5 = [[3, 2, 2, 2, 3], [2, 2, 1, 2, 2], [2, 1, 0, 1, 2], [2, 2, 1, 2, 2], [3, 2, 2, 2, 3]]


def test_names_come_from_the_library():
    assert rt.families("irpe") == ["euclidean", "quantization", "cross", "product"]
    names = rt.families("", True)
    for n in ["euc", "quant", "euclidean_paper", "shaw", "t5", "t5_causal", "product3d", "swin", "beit", "swinv2",
              "decomposed", "sam", "alibi2d", "alibi"]:
        assert n in names
    assert torch.ops.rpe.family_name("euc") == "euclidean"
    assert torch.ops.rpe.family_mode("sam") == "contextual"
    assert torch.ops.rpe.family_mode("swin") == "bias"
    assert torch.ops.rpe.family_spec("product", 1.9, 3.8, 15.2) == "product:index=piecewise,alpha=1.9,beta=3.8,gamma=15.2"
    assert torch.ops.rpe.family_spec("swin", 7, 5, 0) == "swin:window_h=7,window_w=5"
    with pytest.raises(ValueError, match=r"\[rpe\.term_spec\] family = 'hexagonal'; expected one of euclidean \(euc\)"):
        torch.ops.rpe.family_name("hexagonal")
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] method = 'prod'; expected one of euclidean, euc, quantization"):
        rt.get_rpe_config(method="prod")
    assert rt.get_rpe_config(method="quant").rpe_k.method == rt.METHOD.QUANT


def test_spec_text_as_method():
    # product, clip index, beta 2: offset (dr, dc) -> (dr + 2) * 5 + (dc + 2), 25 buckets
    ids = rt.bucket_ids("product:index=clip,beta=2", 0.0, 0.0, 0.0, 0, 3, 3)
    assert ids.shape == (1, 9, 9)
    assert ids[0, 0, 8].item() == (-2 + 2) * 5 + (-2 + 2)
    assert ids[0, 8, 0].item() == (2 + 2) * 5 + (2 + 2)
    assert torch.ops.rpe.num_buckets("product:index=clip,beta=2", 0.0, 0.0, 0.0, 0) == 25


@pytest.mark.skipif(not PLUGIN, reason="the example plugin was not built (RPE_EXAMPLE_MANHATTAN unset)")
def test_user_mapping_from_a_plugin():
    torch.ops.load_library(PLUGIN)
    assert "manhattan" in rt.families("user")
    assert "taxicab" in rt.families("user", True)
    ids = rt.bucket_ids("manhattan", 1.9, 3.8, 15.2, 0, 5, 5)
    assert ids[0, 12].reshape(5, 5).tolist() == MANHATTAN_5X5
    assert torch.ops.rpe.num_buckets("manhattan", 1.9, 3.8, 15.2, 1) == 5  # beta_int + 1, + 1 skip bucket
    # a bias term on it: out[0, 0, i, j] = table[0, id(i, j)], and the table's gradient counts the pairs
    table = (torch.arange(4, dtype=torch.float32) * 10).reshape(1, 4).requires_grad_(True)
    out = rt.term(None, [table], "manhattan", "bias", "k", 1.9, 3.8, 15.2, 0, 5, 5)
    assert out.shape == (1, 1, 25, 25)
    assert torch.equal(out[0, 0, 12].reshape(5, 5), torch.tensor(MANHATTAN_5X5, dtype=torch.float32) * 10)
    out.sum().backward()
    full = rt.bucket_ids("manhattan", 1.9, 3.8, 15.2, 0, 5, 5)[0]
    assert table.grad[0].tolist() == [float((full == b).sum()) for b in range(4)]
    # the spec text sets any parameter: beta 5 -> 6 buckets
    assert torch.ops.rpe.num_buckets("taxicab:beta=5", 0.0, 0.0, 0.0, 0) == 6


# ---------------------------------------------------------------------------------------------
# A registered family (built-in or a plugin's) in the fused attention through TermSlot
# ---------------------------------------------------------------------------------------------

def _qkv(B, H, L, D, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=torch.float64).requires_grad_(requires_grad) for _ in range(3)]


def _bias_from_ids(table, spec, skip, height, width):
    """(1, Ht, L, L) bias table[h, id(i, j)] with the ids of rpe_torch.bucket_ids (the gather in
    Python: independent of the term kernels)."""
    ids = rt.bucket_ids(spec, 0.0, 0.0, 0.0, skip, height, width)[0].long()
    return table[:, ids].unsqueeze(0)


def _composed(q, k, v, bias=None, ctx_q=None, ctx_k=None, ctx_v=None, height=None, width=None):
    """softmax(qs·kᵀ + bias + rpe_k(qs) + rpe_q(ks)ᵀ)·v + rpe_v(a), the terms by rpe_torch.term
    (ctx_*: (spec, table) of a contextual term), the rest plain PyTorch."""
    scale = q.shape[-1] ** -0.5
    qs, ks = q * scale, k * scale
    logits = qs @ k.transpose(-1, -2)
    if bias is not None:
        logits = logits + bias
    if ctx_k is not None:
        logits = logits + rt.term(qs, [ctx_k[1]], ctx_k[0], "contextual", "k", 0, 0, 0, 0, height, width)
    if ctx_q is not None:
        logits = logits + rt.term(ks, [ctx_q[1]], ctx_q[0], "contextual", "q", 0, 0, 0, 0, height, width).transpose(-1, -2)
    a = torch.softmax(logits, -1)
    out = a @ v
    if ctx_v is not None:
        out = out + rt.term(a, [ctx_v[1]], ctx_v[0], "contextual", "v", 0, 0, 0, 0, height, width)
    return out


def test_builtin_family_by_spec_text_in_attention():
    # product with the clip index, beta 1: (2·1+1)² = 9 buckets, ids (dr + 1)·3 + (dc + 1) clipped
    q, k, v = _qkv(2, 2, 12, 4)
    table = torch.randn(2, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    slot = rt.TermSlot("product:index=clip,beta=1", [table], grid=(3, 4))
    assert slot.spec == "product:index=clip,alpha=1.9,beta=1,gamma=15.2"
    assert slot.mode == "bias"
    bias = _bias_from_ids(table, slot.spec, 0, 3, 4)
    assert bias[0, 0, 0, 11].item() == table[0, 0].item()  # (dr, dc) = (-2, -3) clipped to (-1, -1): id 0
    torch.testing.assert_close(rt.attention(q, k, v, rpe_k=slot), _composed(q, k, v, bias), rtol=1e-12, atol=1e-12)
    # params by name equal the text; the window of swin by text equals the positional window
    by_params = rt.TermSlot("product", [table], grid=(3, 4), params={"index": "clip", "beta": 1})
    assert by_params.spec == slot.spec
    t = torch.randn(1, 35, dtype=torch.float64)
    assert rt.TermSlot("swin:window_h=3,window_w=4", [t]).spec == rt.TermSlot("swin", [t], (3, 4)).spec \
        == "swin:window_h=3,window_w=4"
    assert torch.equal(rt.TermSlot("swin:window_h=3,window_w=4", [t])(), rt.TermSlot("swin", [t], (3, 4))())


@pytest.mark.skipif(not PLUGIN, reason="the example plugin was not built (RPE_EXAMPLE_MANHATTAN unset)")
def test_user_mapping_in_attention_by_name():
    torch.ops.load_library(PLUGIN)
    q, k, v = _qkv(2, 2, 12, 4)
    table = torch.tensor([[0.5, -1.0, 2.0, 0.25], [1.5, 0.0, -0.5, 3.0]], dtype=torch.float64)  # (H, K = 4)
    # by name: the family's own defaults (alpha 1.9, beta 3.8, gamma 15.2 from the registry), the
    # positional window only the grid (the reviewer's case: it used to become alpha, beta)
    for slot in (rt.TermSlot("manhattan", [table], grid=(3, 4)), rt.TermSlot("manhattan", [table], (3, 4)),
                 rt.TermSlot("taxicab", [table], (3, 4))):
        assert slot.spec == "manhattan:alpha=1.9,beta=3.8,gamma=15.2"
        bias = _bias_from_ids(table, slot.spec, 0, 3, 4)
        # the hand-checked ids: (0, 0) to (2, 3) is |dr| + |dc| = 5 -> g(5) = 3; to (0, 1) -> 1
        assert bias[0, 1, 0, 11].item() == 3.0 and bias[0, 1, 0, 1].item() == 0.0
        out = rt.attention(q, k, v, rpe_k=slot)
        torch.testing.assert_close(out, _composed(q, k, v, bias), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(slot(), rt.term(None, [table], "manhattan", "bias", "k", 1.9, 3.8, 15.2, 0, 3, 4),
                                   rtol=0, atol=0)
    # with a skip token: the extra bucket (K = 5), the class token's row and column get table[:, 4]
    table5 = torch.cat([table, torch.tensor([[7.0], [-7.0]], dtype=torch.float64)], 1)
    q1, k1, v1 = _qkv(1, 2, 13, 4, seed=3)
    slot = rt.TermSlot("manhattan", [table5], grid=(3, 4), skip=1)
    bias = _bias_from_ids(table5, slot.spec, 1, 3, 4)
    assert bias[0, 0, 0, 5].item() == 7.0 and bias[0, 1, 6, 0].item() == -7.0
    torch.testing.assert_close(rt.attention(q1, k1, v1, rpe_k=slot), _composed(q1, k1, v1, bias), rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not PLUGIN, reason="the example plugin was not built (RPE_EXAMPLE_MANHATTAN unset)")
def test_user_mapping_in_attention_by_spec_text():
    torch.ops.load_library(PLUGIN)
    q, k, v = _qkv(2, 2, 12, 4, seed=5)
    gen = torch.Generator().manual_seed(6)
    # beta 2, gamma 6: ids g(d) in [0, 2], K = 3 (the default parameters give K = 4: the text is read)
    spec = "manhattan:alpha=1.9,beta=2,gamma=6"
    assert torch.ops.rpe.num_buckets(spec, 0.0, 0.0, 0.0, 0) == 3
    tq, tk = (torch.randn(1, 4, 3, dtype=torch.float64, generator=gen) for _ in range(2))
    tv = torch.randn(2, 3, 4, dtype=torch.float64, generator=gen)
    slots = dict(rpe_q=rt.TermSlot("manhattan:beta=2,gamma=6", [tq], grid=(3, 4), mode="contextual"),
                 rpe_k=rt.TermSlot("taxicab", [tk], grid=(3, 4), mode="contextual", params={"beta": 2, "gamma": 6}),
                 rpe_v=rt.TermSlot("manhattan:beta=3", [tv], grid=(3, 4), mode="contextual", params={"beta": 2.0,
                                                                                                     "gamma": 6}))
    for s in slots.values():
        assert s.spec == spec
    out = rt.attention(q, k, v, **slots)
    expected = _composed(q, k, v, ctx_q=(spec, tq), ctx_k=(spec, tk), ctx_v=(spec, tv), height=3, width=4)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    # and the terms matter: without them the output differs
    assert (out - _composed(q, k, v)).abs().max().item() > 1e-3
    # bias mode by text vs the ids' gather: (0, 0) to (2, 3) (distance 5) is id 2 here, 3 with the defaults
    table = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64)
    bias = _bias_from_ids(table, spec, 0, 3, 4)
    assert bias[0, 0, 0, 11].item() == 2.0
    torch.testing.assert_close(rt.attention(q, k, v, rpe_k=rt.TermSlot(spec, [table], grid=(3, 4))),
                               _composed(q, k, v, bias), rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not PLUGIN, reason="the example plugin was not built (RPE_EXAMPLE_MANHATTAN unset)")
def test_user_mapping_in_attention_gradcheck():
    torch.ops.load_library(PLUGIN)
    q, k, v = _qkv(1, 1, 5, 2, seed=7, requires_grad=True)  # skip 1 + a 2x2 grid
    gen = torch.Generator().manual_seed(8)
    spec = "manhattan:beta=2,gamma=6"  # K = 3, + 1 skip bucket
    tb = torch.randn(1, 4, dtype=torch.float64, generator=gen).requires_grad_(True)
    tq = torch.randn(1, 2, 4, dtype=torch.float64, generator=gen).requires_grad_(True)
    tv = torch.randn(1, 4, 2, dtype=torch.float64, generator=gen).requires_grad_(True)

    def f(q, k, v, tb, tq, tv):
        return rt.attention(q, k, v, rpe_q=rt.TermSlot(spec, [tq], grid=(2, 2), skip=1, mode="contextual"),
                            rpe_k=rt.TermSlot("manhattan", [tb], grid=(2, 2), skip=1, params={"beta": 2, "gamma": 6}),
                            rpe_v=rt.TermSlot(spec, [tv], grid=(2, 2), skip=1, mode="contextual"))

    assert torch.autograd.gradcheck(f, (q, k, v, tb, tq, tv), fast_mode=True)
    # every table gets a non-zero gradient through the fused backward
    f(q, k, v, tb, tq, tv).square().sum().backward()
    for t in (tb, tq, tv):
        assert t.grad is not None and t.grad.abs().max().item() > 0


@pytest.mark.skipif(not PLUGIN, reason="the example plugin was not built (RPE_EXAMPLE_MANHATTAN unset)")
def test_user_mapping_termslot_errors():
    torch.ops.load_library(PLUGIN)
    t = torch.zeros(1, 4)
    x = torch.zeros(1, 1, 9, 4)
    with pytest.raises(ValueError, match=r"\[rpe\.term_spec\] parameter = 'delta' of manhattan; expected one of alpha, "
                                         r"beta, gamma"):
        rt.TermSlot("manhattan", [t], grid=(3, 3), params={"delta": 1})
    with pytest.raises(ValueError, match=r"\[rpe\.term_spec\] parameter = 'delta' of manhattan"):
        rt.TermSlot("manhattan:delta=1", [t], grid=(3, 3))
    with pytest.raises(ValueError, match=r"\[rpe\.term_spec\] beta = 'x'; expected a number"):
        rt.TermSlot("manhattan:beta=x", [t], grid=(3, 3))
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] params\['beta'\] = \[2\]; expected a number"):
        rt.TermSlot("manhattan", [t], grid=(3, 3), params={"beta": [2]})
    with pytest.raises(ValueError, match=r"\[rpe\.term_spec\] beta = inf; expected a finite number"):
        rt.TermSlot("manhattan", [t], grid=(3, 3), params={"beta": float("inf")})
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] method = 'chebyshev:beta=2'; expected a family of rpe's "
                                         r"registry"):
        rt.TermSlot("chebyshev:beta=2", [t], grid=(3, 3))
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] params = \[\('beta', 2\)\]; expected a dict"):
        rt.TermSlot("manhattan", [t], grid=(3, 3), params=[("beta", 2)])
    # the mapping's own check, at use, names the parameters and values
    with pytest.raises(ValueError, match=r"\[rpe\.index\.piecewise\] beta = 1\.5 must be >= alpha = 1\.(9|89)"):
        rt.attention(x, x, x, rpe_k=rt.TermSlot("manhattan:beta=1.5", [t], grid=(3, 3)))
    with pytest.raises(ValueError, match=r"height = None, width = None for the 'manhattan' TermSlot, which has no grid"):
        rt.attention(x, x, x, rpe_k=rt.TermSlot("manhattan", [t]))


@pytest.mark.skipif(not CLASH, reason="the clashing test plugin was not built (RPE_TEST_CLASH_PLUGIN unset)")
def test_plugin_with_a_taken_name_is_refused_not_fatal():
    # it used to call std::terminate from the plugin's static initialisation, killing Python
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] plugin = '.*librpe_test_clash_plugin[^']*' cannot be loaded: "
                                         r"\[rpe\.registry\] name = 'euc'; already registered \(euclidean\)"):
        rt.load_plugin(CLASH)
    assert torch.ops.rpe.family_name("euc") == "euclidean"  # the built-in stays, the registry works
    assert "euc" not in rt.families("user", True)
