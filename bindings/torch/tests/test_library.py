"""The torch 2.x registration of every ``torch.ops.rpe`` operator: ``torch.library.opcheck`` with
all its default checks (schema, autograd registration, fake tensor against the real kernel's
shapes, dtypes and strides, AOT dispatch with dynamic shapes) on small float64 inputs, and
``torch.autograd.gradcheck`` straight on each differentiable operator. The RoPE operators also
with their newer arguments (layout half, per-token positions and key positions, integer and
real, a suffix, DINOv3, M-RoPE, V-JEPA 2 in its own layout), the attention's rope_query_suffix
(SAM2's memory attention, L_k != L), and the calls of the older signatures (without them). The
attention operators take their rarely used arguments grouped (spec, params, sizes, indices): the
cases are written by name and grouped with rpe_torch._registrations.attention_op_args (G); the
grouping itself (short lists, slots, the lists' checks) has its own tests at the end."""
import pytest
import torch

import rpe_torch  # noqa: F401  (loads the operators and their registrations)
from rpe_torch._registrations import attention_op_args as G  # the attention operators' grouped arguments

ops = torch.ops.rpe
F64 = torch.float64


def rnd(*shape, grad=True, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)


# alpha 1, beta 2, gamma 8: K = 5 (euclidean, quantization, cross) or 25 (product), +1 with skip
R = (1.0, 2.0, 8.0)
B, H, h, w, D = 2, 2, 2, 3, 4


def term_cases():
    L1 = 1 + h * w
    probs = torch.softmax(rnd(B, H, L1, L1, grad=False, seed=3), -1).requires_grad_()
    return {
        "bias_product_skip": (None, [rnd(H, 26)], "product", "bias", "k", *R, 1, h, w),
        "ctx_k_product_shared": (rnd(B, H, L1, D), [rnd(1, D, 26)], "product", "contextual", "k", *R, 1, h, w),
        "ctx_v_euclidean": (probs, [rnd(H, 6, D)], "euclidean", "contextual", "v", *R, 1, h, w),
        "ctx_k_cross": (rnd(B, H, h * w, D), [rnd(H, D, 5), rnd(H, D, 5, seed=1)], "cross", "contextual", "k", *R, 0,
                        h, w),
        "swin_bias": (None, [rnd(H, 15)], "swin", "bias", "k", 2.0, 3.0, 0.0, 0, h, w),
        "alibi_bias": (None, [rnd(H, 26)], "alibi", "bias", "k", 2.0, 3.0, 0.0, 1, h, w),
    }


def attention_args(save_attn=False, rope=""):
    """The attention operators' arguments (grouped: rpe_torch._registrations.attention_op_args):
    iRPE on q, k and v (Product, contextual), a key padding mask, an additive mask, scale 0.41;
    RoPE-Mixed or RoPE-Axial on request."""
    return G(*_attention_named(rope))


def _attention_named(rope=""):
    L = 1 + h * w
    q, k, v = rnd(B, H, L, D, seed=1), rnd(B, H, L, D, seed=2), rnd(B, H, L, D, seed=3)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, -1] = True
    freqs = rnd(2, H, D // 2, seed=4) if rope == "mixed" else None
    rope_params = [100.0] if rope == "axial" else []
    return (q, k, v, [rnd(1, D, 26, seed=5)], [rnd(H, D, 26, seed=6)], [rnd(1, 26, D, seed=7)],
            "product", "contextual", "product", "contextual", "product", "contextual",
            [*R, 1.0] * 3, h, w, kpm, rnd(L, L, grad=False, seed=8), 0.41, rope, rope_params, freqs, 1 if rope else 0)


def rope_positions_attention_args(rope="axial"):
    return G(*_rope_positions_named(rope))


def _rope_positions_named(rope="axial"):
    """The attention without terms, RoPE with the new options: layout half (vjepa2: its own, at
    D = DV), skip 1, a suffix of 1, queries at integer positions, keys at real ones (L = 1 + 6 + 1)."""
    L = 1 + h * w + 1
    d = DV if rope == "vjepa2" else D
    q, k, v = rnd(B, H, L, d, seed=14), rnd(B, H, L, d, seed=15), rnd(B, H, L, d, seed=16)
    pos = torch.stack([torch.arange(h * w) // w, torch.arange(h * w) % w], 1)
    key_pos = pos.to(F64) * 0.5 - 0.25
    freqs = rnd(2, H, D // 2, seed=17) if rope == "mixed" else None
    params = {"axial": [100.0], "mixed": [], "dinov3": [100.0, 0, 0, 1, 0.1, -0.2, 0.9, 1.1, 1.2],
              "mrope": [100.0, 0, 1, 1, 0], "vjepa2": [100.0]}[rope]
    if rope in ("mrope", "vjepa2"):  # (t, h, w) position ids; vjepa2: (frame, row, col)
        pos, key_pos = torch.cat([pos[:, :1] * 0 + 2, pos], 1), torch.cat([key_pos[:, :1] * 0 + 0.5, key_pos], 1)
    return (q, k, v, [], [], [], "", "", "", "", "", "", [0.0] * 12, 1, 1, None, None, None, rope, params, freqs, 1,
            "vjepa2" if rope == "vjepa2" else "half", pos, key_pos, 1)


def query_suffix_attention_args():
    """SAM2-style memory attention (L_k != L): RoPE-Axial with skip 1, the queries on the grid with
    no trailing token (rope_query_suffix 0, the last argument), the keys at two grids' real
    positions and 2 unrotated trailing tokens (rope_suffix 2): L = 1 + 6, L_k = 1 + 12 + 2."""
    L, Lk = 1 + h * w, 1 + 2 * h * w + 2
    q, k, v = rnd(B, H, L, D, seed=51), rnd(B, H, Lk, D, seed=52), rnd(B, H, Lk, D, seed=53)
    pos = torch.stack([torch.arange(h * w) // w, torch.arange(h * w) % w], 1)
    key_pos = torch.cat([pos, pos]).to(F64) * 0.5 + 0.25
    return G(q, k, v, [], [], [], "", "", "", "", "", "", [0.0] * 12, h, w, None, rnd(L, Lk, grad=False, seed=54), None,
             "axial", [100.0], None, 1, "pairs", None, key_pos, 2, None, None, None, None, None, None, 0)


# V-JEPA 2 (layout vjepa2) needs D >= 6: at D = 14 each of its three slices has 4 channels (2
# frequencies: a partnership's channels turn by different angles) and 2 channels pass through.
DV = 14


def vjepa2_attention_args():
    """The attention with iRPE on k and V-JEPA 2 on the grid (one frame: ids (0, row, col)), skip 1."""
    L = 1 + h * w
    q, k, v = rnd(B, H, L, DV, seed=41), rnd(B, H, L, DV, seed=42), rnd(B, H, L, DV, seed=43)
    return G(q, k, v, [], [rnd(H, DV, 26, seed=44)], [], "", "", "product", "contextual", "", "",
             [0.0] * 4 + [*R, 1.0] + [0.0] * 4, h, w, None, None, None, "vjepa2", [100.0], None, 1, "vjepa2")


def index_attention_args(kind):
    """attention_args with the iRPE terms' index tensors (the operators' trailing arguments):
    "positions" (queries at a permuted grid, keys at other positions), "packed_grids" /
    "packed_positions" (2 images, 2x3 and 2x2 with a class token each, L = 7 + 5), "key_lengths"."""
    pos = torch.stack([torch.arange(h * w) // w, torch.arange(h * w) % w], 1)[torch.tensor([4, 0, 5, 2, 1, 3])]
    if kind in ("positions", "key_lengths"):
        a = _attention_named()
        if kind == "positions":
            idx = (pos, (pos + torch.tensor([1, -2])).to(torch.int32), None, None, None, None)
        else:
            idx = (None, None, None, None, None, torch.tensor([7, 4], dtype=torch.int32))
        return G(*a, "pairs", None, None, 0, *idx)
    L = 7 + 5
    q, k, v = rnd(B, H, L, D, seed=31), rnd(B, H, L, D, seed=32), rnd(B, H, L, D, seed=33)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, 3] = True
    lengths = torch.tensor([7, 5])
    grids = torch.tensor([[2, 3], [2, 2]], dtype=torch.int32) if kind == "packed_grids" else None
    ppos = torch.cat([pos, torch.tensor([[0, 1], [1, 1], [1, 0], [0, 0]])]) if kind == "packed_positions" else None
    return G(q, k, v, [rnd(1, D, 26, seed=5)], [rnd(H, D, 26, seed=6)], [rnd(1, 26, D, seed=7)],
             "product", "contextual", "product", "contextual", "product", "contextual",
             [*R, 1.0] * 3, 0, 0, kpm, rnd(L, L, grad=False, seed=34), 0.41, "", [], None, 0, "pairs", None, None, 0,
             None, None, lengths, grids, ppos, None)


def detached(args):
    def d(a):
        if isinstance(a, torch.Tensor):
            return a.detach()
        if isinstance(a, list):
            return [d(x) for x in a]
        return a
    return tuple(d(a) for a in args)


def op_cases():
    cases = {f"term_forward[{n}]": (ops.term_forward, a) for n, a in term_cases().items()}
    t = term_cases()["ctx_k_product_shared"]
    cases["term_backward"] = (ops.term_backward, detached((t[0], t[1], rnd(B, H, 7, 7, seed=9), *t[2:])))
    cases["attention_forward"] = (ops.attention_forward, attention_args())
    cases["attention_forward[rope_mixed]"] = (ops.attention_forward, attention_args(rope="mixed"))
    cases["attention_forward[rope_axial]"] = (ops.attention_forward, attention_args(rope="axial"))
    a = attention_args()
    cases["attention_forward[scale_none]"] = (ops.attention_forward, (*a[:11], None, *a[12:]))  # scale None: 1/sqrt(D)
    cases["attention_forward_attn"] = (ops.attention_forward_attn, attention_args())
    a = detached(attention_args(rope="mixed"))
    cases["attention_backward"] = (ops.attention_backward, (*a, rnd(B, H, 7, D, grad=False, seed=10)))
    x = rnd(B, H, 1 + h * w, D, seed=11)
    cases["rope_forward[axial]"] = (ops.rope_forward, (x, "axial", [100.0], None, 1, h, w))
    cases["rope_forward[mixed]"] = (ops.rope_forward, (x, "mixed", [], rnd(2, H, D // 2, seed=12), 1, h, w))
    cases["rope_forward[cat]"] = (ops.rope_forward, (x, "cat", [10000.0, 0, 224.0, 0, 0.0, 0, 0, 0], None, 1, h, w))
    cases["rope_backward"] = (ops.rope_backward, detached((x, rnd(*x.shape, seed=13), "mixed", [],
                                                           rnd(2, H, D // 2, seed=12), 1, h, w)))
    # the channel layout, per-token positions (integer, real) and the suffix; DINOv3
    xs = rnd(B, H, 1 + h * w + 2, D, seed=18)
    pos = torch.tensor([[0.5, 1.25], [2.0, -1.0], [3.5, 0.0], [-0.75, 2.5], [1.0, 1.0], [0.0, 0.0]], dtype=F64)
    cases["rope_forward[axial_half_positions]"] = (ops.rope_forward, (xs, "axial", [100.0], None, 1, 1, 1, "half", pos, 2))
    cases["rope_forward[mixed_half_positions]"] = (ops.rope_forward, (xs, "mixed", [], rnd(2, H, D // 2, seed=19), 1, 1,
                                                                      1, "half", pos.to(torch.int64), 2))
    cases["rope_forward[dinov3]"] = (ops.rope_forward, (x, "dinov3", [0.0, 0.5, 40.0, 2, 0.1, -0.2, 0.9, 1.1, 1.2],
                                                        None, 1, h, w, "half"))
    pos3 = torch.cat([torch.tensor([[0.0], [1.0], [1.0], [1.0], [2.0], [3.0]], dtype=F64), pos], 1)  # (t, h, w)
    cases["rope_forward[mrope_positions]"] = (ops.rope_forward, (xs, "mrope", [100.0, 0, 1, 1, 1], None, 1, 1, 1, "half",
                                                                 pos3, 2))
    # V-JEPA 2 in its own layout: on the grid (one frame), at (frame, row, col) ids with a suffix
    xv = rnd(B, H, 1 + h * w + 2, DV, seed=45)
    pos3v = torch.cat([torch.tensor([[0.0], [1.0], [1.0], [2.0], [0.5], [3.0]], dtype=F64), pos], 1)
    cases["rope_forward[vjepa2]"] = (ops.rope_forward, (xv[:, :, :1 + h * w], "vjepa2", [100.0], None, 1, h, w, "vjepa2"))
    cases["rope_forward[vjepa2_positions]"] = (ops.rope_forward, (xv, "vjepa2", [10000.0], None, 1, 1, 1, "vjepa2", pos3v,
                                                                  2))
    cases["rope_backward[vjepa2_positions]"] = (ops.rope_backward, detached((xv, rnd(*xv.shape, seed=46), "vjepa2",
                                                                             [10000.0], None, 1, 1, 1, "vjepa2", pos3v,
                                                                             2)))
    cases["rope_backward[positions]"] = (ops.rope_backward, detached((xs, rnd(*xs.shape, seed=20), "mixed", [],
                                                                      rnd(2, H, D // 2, seed=19), 1, 1, 1, "half",
                                                                      pos, 2)))
    cases["attention_forward[rope_positions]"] = (ops.attention_forward, rope_positions_attention_args())
    cases["attention_forward[rope_mixed_positions]"] = (ops.attention_forward, rope_positions_attention_args("mixed"))
    cases["attention_forward[rope_dinov3_positions]"] = (ops.attention_forward, rope_positions_attention_args("dinov3"))
    cases["attention_forward[rope_mrope_positions]"] = (ops.attention_forward, rope_positions_attention_args("mrope"))
    cases["attention_forward[rope_vjepa2_positions]"] = (ops.attention_forward, rope_positions_attention_args("vjepa2"))
    cases["attention_forward[rope_vjepa2]"] = (ops.attention_forward, vjepa2_attention_args())
    cases["attention_forward_attn[rope_vjepa2_positions]"] = (ops.attention_forward_attn,
                                                              rope_positions_attention_args("vjepa2"))
    a = detached(rope_positions_attention_args("vjepa2"))
    cases["attention_backward[rope_vjepa2_positions]"] = (ops.attention_backward,
                                                          (*a, rnd(B, H, 8, DV, grad=False, seed=47), None))
    cases["attention_forward_attn[rope_positions]"] = (ops.attention_forward_attn, rope_positions_attention_args("mixed"))
    a = detached(rope_positions_attention_args("mixed"))
    cases["attention_backward[rope_positions]"] = (ops.attention_backward, (*a, rnd(B, H, 8, D, grad=False, seed=21),
                                                                            None))
    # RoPE's rope_query_suffix: the queries' own trailing tokens (SAM2's memory attention)
    cases["attention_forward[rope_query_suffix]"] = (ops.attention_forward, query_suffix_attention_args())
    cases["attention_forward_attn[rope_query_suffix]"] = (ops.attention_forward_attn, query_suffix_attention_args())
    a = detached(query_suffix_attention_args())
    cases["attention_backward[rope_query_suffix]"] = (ops.attention_backward,
                                                      (*a, rnd(B, H, 1 + h * w, D, grad=False, seed=55), None))
    # the iRPE terms' per-token positions, packed sequences, key lengths (integer, not differentiated)
    pos = torch.stack([torch.arange(h * w) // w, torch.arange(h * w) % w], 1)[torch.tensor([4, 0, 5, 2, 1, 3])]
    t = term_cases()
    cases["term_forward[ctx_k_positions]"] = (ops.term_forward, (*t["ctx_k_product_shared"], pos, pos.flip(0)))
    cases["term_forward[bias_positions]"] = (ops.term_forward, (*t["bias_product_skip"], pos.to(torch.int32)))
    cases["term_forward[ctx_v_positions]"] = (ops.term_forward, (*t["ctx_v_euclidean"], pos))
    t = t["ctx_k_product_shared"]
    cases["term_backward[positions]"] = (ops.term_backward, detached((t[0], t[1], rnd(B, H, 7, 7, seed=9), *t[2:], pos,
                                                                      None)))
    for kind in ("positions", "packed_grids", "packed_positions", "key_lengths"):
        cases[f"attention_forward[{kind}]"] = (ops.attention_forward, index_attention_args(kind))
    cases["attention_forward_attn[positions]"] = (ops.attention_forward_attn, index_attention_args("positions"))
    cases["attention_forward_attn[key_lengths]"] = (ops.attention_forward_attn, index_attention_args("key_lengths"))
    for kind in ("positions", "packed_grids", "key_lengths"):
        a = detached(index_attention_args(kind))
        n = a[0].shape[2]
        cases[f"attention_backward[{kind}]"] = (ops.attention_backward, (*a, rnd(B, H, n, D, grad=False, seed=35), None))
    cases["rope_mixed_init"] = (ops.rope_mixed_init, (10.0, D, torch.rand(H)))
    cases["table_from_timm"] = (ops.table_from_timm, (rnd(15, H),))
    cases["table_to_timm"] = (ops.table_to_timm, (rnd(H, 15),))
    cases["cpb_table"] = (ops.cpb_table, (rnd(15, H), 2, 3, True))
    cases["cpb_table_backward"] = (ops.cpb_table_backward, (rnd(15, H, grad=False), rnd(H, 15, grad=False), 2, 3, True))
    cases["cpb_bias_forward"] = (ops.cpb_bias_forward, (rnd(15, H), 2, 3, False))
    cases["cpb_bias_backward"] = (ops.cpb_bias_backward, (rnd(15, H, grad=False), rnd(1, H, 6, 6, grad=False), 2, 3,
                                                          False))
    cases["resize_rel_pos"] = (ops.resize_rel_pos, (rnd(5, D), 7))
    cases["resize_rel_pos_backward"] = (ops.resize_rel_pos_backward, (rnd(7, D, grad=False), 5))
    cases["decomposed_tables"] = (ops.decomposed_tables, (rnd(3, D), rnd(7, D), h, w, 1, True))
    cases["decomposed_tables_backward"] = (ops.decomposed_tables_backward,
                                           (rnd(1, D, 6, grad=False), rnd(1, D, 6, grad=False), 3, 7, h, w, 1, True))
    return cases


CASES = op_cases()


# Variants that differ from a checked case only in a string argument (same shapes, same autograd
# path): gradcheck only, to keep the suite short.
GRADCHECK_ONLY = {"term_forward[swin_bias]", "term_forward[alibi_bias]", "attention_forward[rope_axial]",
                  "rope_forward[cat]", "attention_forward[rope_dinov3_positions]", "rope_forward[axial_half_positions]"}


@pytest.mark.parametrize("name", sorted(set(CASES) - GRADCHECK_ONLY))
def test_opcheck(name):
    op, args = CASES[name]
    torch.library.opcheck(op, args)  # test_schema, test_autograd_registration, test_faketensor, test_aot_dispatch_dynamic


def test_every_tensor_operator_is_checked():
    names = {n.split("[")[0] for n in CASES}
    tensor_ops = {n for n in dir(ops) if not n.startswith("_")} - {
        # no tensor argument: configuration helpers (opcheck needs a tensor to trace)
        "relative_log_coords", "alibi_2d_table", "alibi_slopes", "num_buckets", "bucket_ids",
        # the registry's names and specs, the caches' budget and counters
        "families", "family_name", "family_mode", "family_spec", "slot_spec", "set_cache_budget", "cache_stats",
        "clear_caches"}
    tensor_ops = {n for n in tensor_ops if isinstance(getattr(ops, n), torch._ops.OpOverloadPacket)}
    assert tensor_ops <= names, tensor_ops - names


@pytest.mark.parametrize("name", sorted(n for n in CASES if "backward" not in n and n != "rope_mixed_init"))
def test_gradcheck(name):
    op, args = CASES[name]
    flat = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    flat += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor) and t.requires_grad]

    def f(*inputs):
        it = iter(inputs)
        new = [next(it) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
        new = [[next(it) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in a] if isinstance(a, list)
               else a for a in new]
        out = op(*new)
        return out[0] if isinstance(out, list) and name.startswith("attention") else out

    # The attention operators have ~800 inputs: gradcheck's fast mode (the numerical and analytical
    # Jacobians compared along random directions, one per side) instead of every column (test time).
    fast = name.startswith("attention")
    assert torch.autograd.gradcheck(f, tuple(flat), eps=1e-6, atol=1e-7, rtol=1e-6, fast_mode=fast)


def test_no_autograd_function_remains():
    import inspect

    import rpe_torch.vit
    for mod in (rpe_torch, rpe_torch.vit):
        for name, obj in vars(mod).items():
            assert not (inspect.isclass(obj) and issubclass(obj, torch.autograd.Function)), name


def test_attention_schema_groups_the_rarely_used_arguments():
    """The attention operators keep a short schema (torch.library's autograd layer walks it in
    O(arguments²) on every grad-mode call, docs/torch.md): 14 arguments, the backward 16."""
    names = [a.name for a in ops.attention_forward.default._schema.arguments]
    assert names == ["q", "k", "v", "tables_q", "tables_k", "tables_v", "spec", "params", "sizes", "key_padding_mask",
                     "attn_mask", "scale", "rope_freqs", "indices"]
    assert [a.name for a in ops.attention_forward_attn.default._schema.arguments] == names
    assert [a.name for a in ops.attention_backward.default._schema.arguments] == names + ["grad_out", "attn"]


def test_attention_short_lists_take_the_defaults():
    """Empty spec, params, sizes and indices: no term, no RoPE, no index tensor (the plain
    softmax attention, checked against torch's); shorter lists take the missing entries' defaults
    (layout "pairs", rope_skip 0, rope_suffix 0, rope_query_suffix -1); attention_op_args by name
    gives the same result."""
    q, k, v = rnd(B, H, 5, D, grad=False, seed=81), rnd(B, H, 5, D, grad=False, seed=82), rnd(B, H, 5, D, grad=False,
                                                                                                seed=83)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5)
    got = ops.attention_forward(q, k, v, [], [], [], "", [], [], None, None, 0.5, None, [])
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    # RoPE-Axial on a 2x2 grid after one skip token: spec and sizes cut after the form and rope_skip
    short = ops.attention_forward(q, k, v, [], [], [], ";;;;;;axial", [0.0] * 12 + [100.0], [2, 2, 1], None, None, 0.5,
                                  None, [])
    full = ops.attention_forward(*G(q, k, v, [], [], [], "", "", "", "", "", "", [0.0] * 12, 2, 2, None, None, 0.5,
                                    rope_form="axial", rope_params=[100.0], rope_skip=1, rope_layout="pairs",
                                    rope_suffix=0, rope_query_suffix=-1))
    torch.testing.assert_close(short, full, atol=0, rtol=0)
    assert not torch.allclose(short, want)  # the RoPE did rotate q and k


def test_attention_list_lengths_are_checked_naming_the_list():
    q = rnd(B, H, 5, D, grad=False, seed=84)
    base = [q, q, q, [], [], [], "", [], [], None, None, None, None, []]

    def call(i, value):
        a = list(base)
        a[i] = value
        return ops.attention_forward(*a)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] spec = ';;product;contextual;;;;pairs;' holds 9 "
                                         r"semicolon-separated entries; expected at most 8: method_q, mode_q, method_k, mode_k, "
                                         r"method_v, mode_v, rope_form, rope_layout$"):
        call(6, ";;product;contextual;;;;pairs;")
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] method_k = 'a;b'; expected a name without ';'"):
        G(q, q, q, method_k="a;b")
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] params holds 4 values; expected none \(no term\) or 12 "
                                         r"\(alpha, beta, gamma, skip of the q, k and v terms\) followed by the RoPE's "
                                         r"params$"):
        call(7, [1.0, 2.0, 8.0, 1.0])
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] sizes holds 6 values with 0 index tensors; expected at most 5: "
                                         r"height, width, rope_skip, rope_suffix, rope_query_suffix, then each index "
                                         r"tensor's slot \(0 rope_positions, 1 rope_key_positions, 2 rpe_positions, 3 "
                                         r"rpe_key_positions, 4 packed_lengths, 5 packed_grids, 6 packed_positions, 7 "
                                         r"key_lengths\)$"):
        call(8, [1] * 6)
    lengths = torch.tensor([5, 4])
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] indices holds 9 tensors; expected at most 8 \(one per slot"):
        call(13, [lengths] * 9)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] sizes holds 2 values with 1 index tensors; expected 5 \+ one "
                                         r"slot per index tensor: height, width"):
        ops.attention_forward(q, q, q, [], [], [], "", [], [1, 1], None, None, None, None, [lengths])
    for slots, bad in (([8], "sizes\\[5\\] = 8"), ([7, 7], "sizes\\[6\\] = 7"), ([-1], "sizes\\[5\\] = -1")):
        with pytest.raises(ValueError, match=rf"^\[rpe\.torch\] {bad}; expected the slot of indices\[\d\], 0\.\.7 and "
                                             r"not given twice"):
            ops.attention_forward(q, q, q, [], [], [], "", [], [1, 1, 0, 0, -1, *slots], None, None, None, None,
                                  [lengths] * len(slots))
    # each index tensor keeps its own name in the messages: key_lengths (slot 7), then the same
    # tensor in slot 4 (packed_lengths: its own checks)
    with pytest.raises(TypeError, match=r"\[rpe\.torch\] key_lengths has dtype torch\.float64; expected an integer"):
        ops.attention_forward(q, q, q, [], [], [], "", [], [1, 1, 0, 0, -1, 7], None, None, None, None,
                              [torch.full((B,), 5.0, dtype=F64)])
    # the slot decides: valid key lengths [5, 4] mask the second batch element's last key
    got = ops.attention_forward(q, q, q, [], [], [], "", [], [1, 1, 0, 0, -1, 7], None, None, None, None, [lengths])
    kpm = torch.tensor([[False] * 5, [False] * 4 + [True]])
    torch.testing.assert_close(got, ops.attention_forward(q, q, q, [], [], [], "", [], [], kpm, None, None, None, []),
                               atol=1e-12, rtol=1e-12)


# The values of the grouped arguments that cannot have any effect, by name (attention_op_args),
# and the ValueError each gets (make_attention_args: refused, not ignored).
NO_EFFECT = {
    "mode_q": (dict(mode_q="bias"), r"mode_q = 'bias' \(spec entry 1\) without a method \(method_q = ''\); expected '' "
                                    r"\(slot q has no term: nothing reads its mode\)"),
    "mode_k": (dict(mode_k="contextual"), r"mode_k = 'contextual' \(spec entry 3\) without a method \(method_k = ''\); "
                                          r"expected '' \(slot k has no term: nothing reads its mode\)"),
    "mode_v": (dict(mode_v="ctx"), r"mode_v = 'ctx' \(spec entry 5\) without a method \(method_v = ''\)"),
    "alpha_q": (dict(params=[1.0] + [0.0] * 11), r"params\[0\] = 1 \(alpha of slot q\) without a method "
                                                 r"\(method_q = ''\); expected 0 \(slot q has no term: nothing reads it\)"),
    "beta_k": (dict(params=[0.0] * 5 + [0.5] + [0.0] * 6), r"params\[5\] = 0\.5 \(beta of slot k\) without a method "
                                                           r"\(method_k = ''\); expected 0"),
    "gamma_v": (dict(params=[0.0] * 10 + [-8.0, 0.0]), r"params\[10\] = -8 \(gamma of slot v\) without a method "
                                                       r"\(method_v = ''\); expected 0"),
    "skip_v": (dict(params=[0.0] * 11 + [1.0]), r"params\[11\] = 1 \(skip of slot v\) without a method "
                                                r"\(method_v = ''\); expected 0"),
    "nan_k": (dict(params=[0.0] * 4 + [float("nan")] + [0.0] * 7), r"params\[4\] = nan \(alpha of slot k\) without a "
                                                                   r"method"),
    "rope_layout": (dict(rope_layout="half"), r"rope_layout = 'half' \(spec entry 7\) without a RoPE \(rope_form = ''\); "
                                              r"expected 'pairs' \(the default: nothing reads it without a RoPE\)"),
    "rope_layout_empty": (dict(rope_layout=""), r"rope_layout = '' \(spec entry 7\) without a RoPE"),
    "rope_params": (dict(rope_params=[100.0, 2.0]), r"params\[12\] = 100 \(the first of 2 RoPE params; params holds 14 "
                                                    r"values\) without a RoPE \(rope_form = ''\); expected 12 values, the "
                                                    r"terms' alone"),
    "rope_skip": (dict(rope_skip=1), r"rope_skip = 1 \(sizes\[2\]\) without a RoPE \(rope_form = ''\); expected 0 \(the "
                                     r"default: nothing reads it without a RoPE\)"),
    "rope_suffix": (dict(rope_suffix=2), r"rope_suffix = 2 \(sizes\[3\]\) without a RoPE \(rope_form = ''\); expected 0"),
    "rope_query_suffix": (dict(rope_query_suffix=0), r"rope_query_suffix = 0 without a RoPE \(rope_form = ''\); "
                                                     r"expected -1"),
    "rope_freqs": (dict(rope_freqs=rnd(2, H, D // 2, grad=False)), r"rope_freqs of shape \(2, 2, 2\) is given without a "
                                                                   r"RoPE \(rope_form = ''\); expected None \(only the "
                                                                   r"'mixed' form reads it\)"),
    "rope_positions": (dict(rope_positions=torch.zeros(h * w, 2)), r"rope_positions \(index slot 0\) of shape \(6, 2\) is "
                                                                   r"given without a RoPE \(rope_form = ''\); expected none"),
    "rope_key_positions": (dict(rope_key_positions=torch.zeros(h * w, 2)), r"rope_key_positions \(index slot 1\) of shape "
                                                                           r"\(6, 2\) is given without a RoPE"),
}


@pytest.mark.parametrize("case", sorted(NO_EFFECT))
def test_attention_values_without_effect_are_refused(case):
    """A value of the grouped arguments that nothing would read (a mode or term params for a slot
    without a method, a RoPE setting without a RoPE form) is a ValueError naming the argument, its
    entry and its value, from each of the three operators (they share make_attention_args), where
    it used to be ignored; the same call without it runs (the defaults are accepted)."""
    q = rnd(B, H, h * w, D, grad=False, seed=86)
    named, message = NO_EFFECT[case]
    base = dict(height=h, width=w)
    for name in ("attention_forward", "attention_forward_attn"):
        with pytest.raises(ValueError, match=r"^\[rpe\.torch\] " + message):
            getattr(ops, name)(*G(q, q, q, **base, **named))
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] " + message):
        ops.attention_backward(*G(q, q, q, **base, **named), q, None)
    want = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(ops.attention_forward(*G(q, q, q, **base)), want, atol=1e-12, rtol=1e-12)


def test_attention_defaults_given_explicitly_are_accepted():
    """Every neutral default written out (empty modes, zero params for the slots without a method,
    layout 'pairs', rope_skip 0, rope_suffix 0, rope_query_suffix -1, as attention_op_args sends
    them) gives the result of the empty lists; the values refused without a method or a RoPE are
    read with one (a mode and params with a method, rope_skip with a form)."""
    q = rnd(B, H, 1 + h * w, D, grad=False, seed=87)
    empty = ops.attention_forward(q, q, q, [], [], [], "", [], [], None, None, None, None, [])
    full = ops.attention_forward(q, q, q, [], [], [], ";;;;;;;pairs", [0.0] * 12, [1, 1, 0, 0, -1], None, None, None,
                                 None, [])
    torch.testing.assert_close(full, empty, atol=0, rtol=0)
    # with a method, its mode and params are read: the term changes the result
    t = rnd(H, 26, grad=False, seed=88)
    with_term = ops.attention_forward(*G(q, q, q, [], [t], [], method_k="product", mode_k="bias",
                                         params=[0.0] * 4 + [1.0, 2.0, 8.0, 1.0] + [0.0] * 4, height=h, width=w))
    assert not torch.allclose(with_term, empty)
    # with a form, rope_skip is read: RoPE-Axial after one unrotated token
    roped = ops.attention_forward(*G(q, q, q, rope_form="axial", rope_params=[100.0], rope_skip=1, height=h, width=w))
    assert not torch.allclose(roped, empty)


def test_attention_term_values_a_method_does_not_read_are_refused():
    """alpha, beta, gamma that the slot's method does not read: a spec text sets its own parameters
    (all three refused unless 0; its skip is read), a registry family reads its first number /
    integer parameters only ("swin": window_h, window_w; gamma refused unless 0); the iRPE methods
    read all three."""
    q = rnd(B, H, 1 + h * w, D, grad=False, seed=89)
    t = rnd(H, D, 26, grad=False, seed=90)
    text = "product:alpha=1,beta=2,gamma=8"
    for j, value in enumerate(("alpha", "beta", "gamma")):
        params = [0.0] * 4 + [0.0, 0.0, 0.0, 1.0] + [0.0] * 4
        params[4 + j] = 2.0
        with pytest.raises(ValueError, match=rf"^\[rpe\.torch\] params\[{4 + j}\] = 2 \({value} of slot k\) with method_k "
                                             rf"= '{text}', a spec text, which sets its own parameters; expected 0 "
                                             rf"\(nothing reads it: set {value} in the text\)"):
            ops.attention_forward(*G(q, q, q, [], [t], [], method_k=text, mode_k="contextual", params=params, height=h,
                                     width=w))
    by_text = ops.attention_forward(*G(q, q, q, [], [t], [], method_k=text, mode_k="contextual",
                                       params=[0.0] * 4 + [0.0, 0.0, 0.0, 1.0] + [0.0] * 4, height=h, width=w))
    by_name = ops.attention_forward(*G(q, q, q, [], [t], [], method_k="product", mode_k="contextual",
                                       params=[0.0] * 4 + [1.0, 2.0, 8.0, 1.0] + [0.0] * 4, height=h, width=w))
    torch.testing.assert_close(by_text, by_name, atol=0, rtol=0)
    # swin on a 2x3 window reads (alpha, beta) as (window_h, window_w), not gamma
    qs = rnd(B, H, h * w, D, grad=False, seed=91)
    ts = rnd(H, 15, grad=False, seed=92)
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] params\[6\] = 0\.5 \(gamma of slot k\) with method_k = 'swin', "
                                         r"which reads alpha as window_h, beta as window_w; expected 0 \(nothing reads "
                                         r"it\)"):
        ops.attention_forward(*G(qs, qs, qs, [], [ts], [], method_k="swin", mode_k="bias",
                                 params=[0.0] * 4 + [2.0, 3.0, 0.5, 0.0] + [0.0] * 4, height=h, width=w))
    swin = ops.attention_forward(*G(qs, qs, qs, [], [ts], [], method_k="swin", mode_k="bias",
                                    params=[0.0] * 4 + [2.0, 3.0, 0.0, 0.0] + [0.0] * 4, height=h, width=w))
    assert not torch.allclose(swin, torch.nn.functional.scaled_dot_product_attention(qs, qs, qs))


def test_rpe_torch_attention_sends_no_value_without_effect(monkeypatch):
    """rpe_torch.attention passes the neutral defaults for what it does not use (a slot without a
    module: method and mode '', params 0; no rope: form '', layout 'pairs', no RoPE params,
    rope_skip 0, rope_suffix 0, rope_query_suffix -1, no freqs or RoPE positions), so the checks of
    make_attention_args never refuse its calls; a spec-text term (TermSlot) gets alpha, beta,
    gamma 0."""
    import rpe_torch as rt
    sent = []
    real = rt._registrations.attention_op_args

    def recording(*a, **kw):
        sent.append(real(*a, **kw))
        return sent[-1]

    monkeypatch.setattr(rt._registrations, "attention_op_args", recording)
    q = rnd(B, H, h * w, D, grad=False, seed=93)
    slot = rt.TermSlot("swin", [rnd(H, 15, grad=False, seed=94)], window=(h, w))
    rt.attention(q, q, q, rpe_k=slot, height=h, width=w)
    spec, params, sizes = sent[-1][6:9]
    assert spec.split(";")[:2] == ["", ""] and spec.split(";")[4:] == ["", "", "", "pairs"]
    assert ":" in spec.split(";")[2] and spec.split(";")[3] == "bias"
    assert params == [0.0] * 12 and sizes == [h, w, 0, 0, -1] and sent[-1][12] is None and sent[-1][13] == []
    rt.attention(q, q, q, rope=rt.RoPEAxial(theta=100.0), height=h, width=w)
    spec, params, sizes = sent[-1][6:9]
    assert spec == ";;;;;;axial;pairs" and params == [0.0] * 12 + [100.0] and sizes == [h, w, 0, 0, -1]


@pytest.mark.skipif(not rpe_torch.has_cuda_kernels(), reason="the operator library was built without its CUDA kernels")
@pytest.mark.parametrize("case", ["mode_k", "beta_k", "rope_layout", "rope_skip", "rope_freqs", "rope_positions"])
def test_cuda_operators_refuse_values_without_effect_as_the_cpu(case):
    """The CUDA operators share make_attention_args: called through the dispatcher's CUDA key with
    CPU tensors (no device needed), a value without effect gets the CPU's message before the
    device check."""
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    q = rnd(B, H, h * w, D, grad=False, seed=95)
    named, message = NO_EFFECT[case]
    for name in ("attention_forward", "attention_forward_attn"):
        with pytest.raises(ValueError, match=r"^\[rpe\.torch\] " + message):
            getattr(ops, name).default.redispatch(cuda, *G(q, q, q, height=h, width=w, **named))
    with pytest.raises(ValueError, match=r"^\[rpe\.torch\] " + message):
        ops.attention_backward.default.redispatch(cuda, *G(q, q, q, height=h, width=w, **named), q, None)
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] no argument is a CUDA tensor"):
        ops.attention_forward.default.redispatch(cuda, *G(q, q, q, height=h, width=w))
