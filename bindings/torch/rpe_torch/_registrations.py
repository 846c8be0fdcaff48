"""torch 2.x registrations of the ``torch.ops.rpe`` operators (schemas and CPU kernels in
bindings/torch/src/ops.cpp): a fake (meta) kernel for every operator, with the output shapes,
dtypes and strides of the real kernels (every output is a fresh contiguous tensor), so that
``torch.compile``, ``torch.export`` and FakeTensor tracing see through them; the autograd formula
of every differentiable forward operator (``torch.library.register_autograd``: setup_context +
backward, over the backward operators); and CPU and CUDA autocast (see :func:`_register_autocast`).

Nothing here computes: the fake kernels only shape, the backward formulas call the C++ backward
operators. Imported by ``rpe_torch`` right after it loads the operator library.
"""
from __future__ import annotations

import torch

_ops = torch.ops.rpe
_lib = "rpe"

#: ``mode`` strings of the term operators that mean contextual (the others: bias).
_CONTEXTUAL = ("contextual", "ctx")


def _first_order():
    """Raises when a backward formula runs with grad mode on (``create_graph=True`` through an
    rpe_torch operator, e.g. a gradient penalty): the backward operators have no derivative, so
    the second-order terms would silently be dropped."""
    if torch.is_grad_enabled():
        raise RuntimeError("[rpe.torch] the rpe_torch operators are differentiable once: a double backward "
                           "(create_graph=True through them, e.g. a gradient penalty) is not supported")


def _masked(ctx, grads):
    """The backward's result shaped as autograd expects it: one entry per input actually passed
    (defaulted trailing arguments may be absent), None where no gradient is needed, a list (of
    gradients or None) for each tensor-list input, [] for an empty list argument."""
    out = []
    for g, need in zip(grads, ctx.needs_input_grad):
        if isinstance(need, (list, tuple)):
            out.append([gi if n else None for gi, n in zip(g, need)] if g is not None else [None] * len(need))
        else:
            out.append(g if need else None)
    return tuple(out)


def _empty(like, shape, dtype=None):
    return like.new_empty(shape, dtype=dtype if dtype is not None else like.dtype)


def _fake(name):
    return torch.library.register_fake(f"{_lib}::{name}")


# ---------------------------------------------------------------------------------------------
# Terms
# ---------------------------------------------------------------------------------------------

def _term_out_shape(x, tables, mode, target, skip, height, width, positions=None, key_positions=None):
    # (L, L_k): L queries (the grid, or skip + positions), L_k keys (skip + key_positions, else L)
    n = skip + (positions.shape[0] if positions is not None else height * width)
    nk = skip + key_positions.shape[0] if key_positions is not None else n
    if mode not in _CONTEXTUAL:
        return tables[0], (1, tables[0].shape[0], n, nk)
    if target == "v":
        return x, (x.shape[0], x.shape[1], x.shape[2], tables[0].shape[2])
    if key_positions is None:  # one token set: x's L
        return x, (x.shape[0], x.shape[1], x.shape[2], x.shape[2])
    return x, (x.shape[0], x.shape[1], n, nk)


@_fake("term_forward")
def _term_forward_fake(x, tables, method, mode, target, alpha, beta, gamma, skip, height, width, positions=None,
                       key_positions=None):
    like, shape = _term_out_shape(x, tables, mode, target, skip, height, width, positions, key_positions)
    return _empty(like, shape, tables[0].dtype)


@_fake("term_backward")
def _term_backward_fake(x, tables, grad_out, method, mode, target, alpha, beta, gamma, skip, height, width,
                        positions=None, key_positions=None):
    grad_x = _empty(x, x.shape) if mode in _CONTEXTUAL and x is not None else _empty(grad_out, (0,))
    return [grad_x, *(_empty(t, t.shape) for t in tables)]


def _term_setup(ctx, inputs, output):
    x, tables, *spec = inputs
    # spec: method, mode, target, alpha, beta, gamma, skip, height, width, then (defaulted, maybe
    # absent) positions, key_positions: integer tensors, saved (not differentiated)
    spec = list(spec) + [None, None][len(spec) - 9:]
    pos = [t for t in spec[9:] if t is not None]
    ctx.has_pos = tuple(t is not None for t in spec[9:])
    ctx.spec = tuple(spec[:9])
    ctx.has_x = x is not None
    ctx.n_tables = len(tables)
    ctx.save_for_backward(*([x] if x is not None else []), *tables, *pos)


def _term_backward(ctx, grad_out):
    _first_order()
    saved = list(ctx.saved_tensors)
    x = saved.pop(0) if ctx.has_x else None
    tables, rest = saved[:ctx.n_tables], iter(saved[ctx.n_tables:])
    pos, key_pos = (next(rest) if has else None for has in ctx.has_pos)
    grads = _ops.term_backward(x, tables, grad_out.contiguous(), *ctx.spec, pos, key_pos)
    return _masked(ctx, (grads[0] if ctx.has_x else None, list(grads[1:]), *([None] * 11)))


torch.library.register_autograd(f"{_lib}::term_forward", _term_backward, setup_context=_term_setup)


# ---------------------------------------------------------------------------------------------
# Fused attention
# ---------------------------------------------------------------------------------------------

#: The entries of the attention operators' grouped arguments, in order (ops.cpp's schema): ``spec``
#: (one string, the names separated by semicolons: torch.jit.trace takes no ``str[]``, and
#: mapping specs hold commas, e.g. ``"swin:window_h=2,window_w=3"``), ``sizes`` (ints; then, with
#: index tensors, each one's slot: its index in ATTENTION_INDICES) and ``indices`` (the index
#: tensors given: torch.jit.trace takes no ``Tensor?[]``); ``params`` holds the 12 term values
#: (alpha, beta, gamma, skip of q, k, v) followed by the RoPE's params.
ATTENTION_SPEC = ("method_q", "mode_q", "method_k", "mode_k", "method_v", "mode_v", "rope_form", "rope_layout")
ATTENTION_SIZES = ("height", "width", "rope_skip", "rope_suffix", "rope_query_suffix")
ATTENTION_INDICES = ("rope_positions", "rope_key_positions", "rpe_positions", "rpe_key_positions", "packed_lengths",
                     "packed_grids", "packed_positions", "key_lengths")
#: Position of ``indices`` (the RoPE's positions and the iRPE terms' index tensors) in the
#: attention operators' arguments.
ATTENTION_INDEX_ARG = 13


def attention_op_args(q, k, v, tables_q=(), tables_k=(), tables_v=(), method_q="", mode_q="", method_k="", mode_k="",
                      method_v="", mode_v="", params=(), height=1, width=1, key_padding_mask=None, attn_mask=None,
                      scale=None, rope_form="", rope_params=(), rope_freqs=None, rope_skip=0, rope_layout="pairs",
                      rope_positions=None, rope_key_positions=None, rope_suffix=0, rpe_positions=None,
                      rpe_key_positions=None, packed_lengths=None, packed_grids=None, packed_positions=None,
                      key_lengths=None, rope_query_suffix=-1):
    """The positional arguments of ``torch.ops.rpe.attention_forward`` (and
    ``attention_forward_attn``; ``attention_backward`` takes them followed by grad_out and attn)
    from each argument by its own name: the operators group the rarely used ones (``spec``: the
    names of :data:`ATTENTION_SPEC` joined by ``;``, ``params``: the 12 term values then
    ``rope_params``, ``sizes``: :data:`ATTENTION_SIZES` then the slot (index in
    :data:`ATTENTION_INDICES`) of each tensor of ``indices``, the index tensors given), since
    torch.library's autograd layer costs O(arguments²) per call. ``params``: () (no term) or the 12
    term values. Returns a 14-tuple (q, k, v, tables_q, tables_k, tables_v, spec, params, sizes,
    key_padding_mask, attn_mask, scale, rope_freqs, indices). Raises ValueError for a name of
    ``spec`` holding a ``;``. The defaults are the values nothing reads; the operators refuse any
    other value where it could have no effect (a mode or term params for a slot without a method,
    a RoPE setting without ``rope_form``: ValueError naming it, ops_common.hpp
    check_grouped_effects)."""
    names = [method_q, mode_q, method_k, mode_k, method_v, mode_v, rope_form, rope_layout]
    for what, name in zip(ATTENTION_SPEC, names):
        if ";" in name:
            raise ValueError(f"[rpe.torch] {what} = {name!r}; expected a name without ';' (the operators' spec joins "
                             "the names with semicolons)")
    params, rope_params = list(params), list(rope_params)
    if rope_params and not params:
        params = [0.0] * 12
    given = [(slot, t) for slot, t in enumerate((rope_positions, rope_key_positions, rpe_positions, rpe_key_positions,
                                                 packed_lengths, packed_grids, packed_positions, key_lengths))
             if t is not None]
    return (q, k, v, list(tables_q), list(tables_k), list(tables_v), ";".join(names), params + rope_params,
            [height, width, rope_skip, rope_suffix, rope_query_suffix, *(slot for slot, _ in given)], key_padding_mask,
            attn_mask, scale, rope_freqs, [t for _, t in given])


def _rope_form(spec):
    entries = spec.split(";")
    return entries[6] if len(entries) > 6 else ""


@_fake("attention_forward")
def _attention_forward_fake(q, k, v, tables_q, tables_k, tables_v, spec, params, sizes, key_padding_mask, attn_mask,
                            scale, rope_freqs, indices):
    return _empty(q, q.shape)


@_fake("attention_forward_attn")
def _attention_forward_attn_fake(q, k, v, tables_q, tables_k, tables_v, spec, params, sizes, key_padding_mask,
                                 attn_mask, scale, rope_freqs, indices):
    b, h, n = q.shape[0], q.shape[1], q.shape[2]
    return [_empty(q, q.shape), _empty(q, (b, h, n, k.shape[2]))]  # (B, H, L, L_k)


@_fake("attention_backward")
def _attention_backward_fake(q, k, v, tables_q, tables_k, tables_v, spec, params, sizes, key_padding_mask, attn_mask,
                             scale, rope_freqs, indices, grad_out, attn=None):
    grads = [_empty(q, q.shape), _empty(k, k.shape), _empty(v, v.shape)]
    for slot_tables in (tables_q, tables_k, tables_v):
        grads.extend(_empty(t, t.shape) for t in slot_tables)
    if _rope_form(spec) == "mixed" and rope_freqs is not None:
        grads.append(_empty(rope_freqs, rope_freqs.shape))
    return grads


def _attention_setup(ctx, inputs, output):
    q, k, v, tq, tk, tv, spec, params, sizes, kpm, attn_mask, scale, freqs, indices = inputs
    ctx.counts = (len(tq), len(tk), len(tv))
    ctx.spec = (spec, params, sizes, scale)
    saved = [kpm, attn_mask, freqs]  # with the index tensors: saved, not differentiated
    ctx.has = tuple(t is not None for t in saved)
    ctx.n_indices = len(indices)
    ctx.with_attn = isinstance(output, (list, tuple))
    extra = [t for t in saved if t is not None] + list(indices)
    if ctx.with_attn:
        ctx.mark_non_differentiable(output[1])
        # the probabilities' gradient stays None: materialised, it would be a (B, H, L, L_k) tensor of
        # zeros allocated and filled at every backward, never read
        ctx.set_materialize_grads(False)
        extra.append(output[1])
    ctx.save_for_backward(q, k, v, *tq, *tk, *tv, *extra)


def _attention_backward(ctx, grad_out):
    _first_order()
    if isinstance(grad_out, (list, tuple)):  # attention_forward_attn: [grad_out, grad_attn (not differentiable, None)]
        grad_out = grad_out[0]
    if grad_out is None:  # (grads not materialised with the probabilities) out's own gradient undefined: zero
        grad_out = torch.zeros_like(ctx.saved_tensors[0])
    q, k, v, *rest = ctx.saved_tensors
    a, b, c = ctx.counts
    tq, tk, tv, rest = rest[:a], rest[a:a + b], rest[a + b:a + b + c], rest[a + b + c:]
    it = iter(rest)
    kpm, attn_mask, freqs = (next(it) if has else None for has in ctx.has)
    indices = [next(it) for _ in range(ctx.n_indices)]
    attn = next(it) if ctx.with_attn else None
    spec, params, sizes, scale = ctx.spec
    grads = _ops.attention_backward(q, k, v, list(tq), list(tk), list(tv), spec, params, sizes, kpm, attn_mask, scale,
                                    freqs, indices, grad_out.contiguous(), attn)
    gq, gk, gv = grads[:3]
    g = grads[3:]
    gtq, gtk, gtv = list(g[:a]), list(g[a:a + b]), list(g[a + b:a + b + c])
    gfreqs = g[a + b + c] if freqs is not None and _rope_form(spec) == "mixed" else None
    # spec, params, sizes, the masks, scale and the index tensors have none
    return _masked(ctx, (gq, gk, gv, gtq, gtk, gtv, None, None, None, None, None, None, gfreqs, None))


for _name in ("attention_forward", "attention_forward_attn"):
    torch.library.register_autograd(f"{_lib}::{_name}", _attention_backward, setup_context=_attention_setup)


# ---------------------------------------------------------------------------------------------
# 2D RoPE
# ---------------------------------------------------------------------------------------------

@_fake("rope_forward")
def _rope_forward_fake(x, form, params, freqs, skip, height, width, layout="pairs", positions=None, suffix=0):
    return _empty(x, x.shape)


@_fake("rope_backward")
def _rope_backward_fake(x, grad_y, form, params, freqs, skip, height, width, layout="pairs", positions=None, suffix=0):
    mixed = form == "mixed" and freqs is not None
    return [_empty(x, x.shape), _empty(freqs, freqs.shape) if mixed else _empty(x, (0,))]


def _rope_setup(ctx, inputs, output):
    x, form, params, freqs, skip, height, width, *tail = inputs
    layout, positions, suffix = list(tail) + ["pairs", None, 0][len(tail):]
    ctx.spec = (form, params, skip, height, width, layout, suffix)
    ctx.has = (freqs is not None, positions is not None)
    ctx.save_for_backward(x, *(t for t in (freqs, positions) if t is not None))


def _rope_backward(ctx, grad_y):
    _first_order()
    x, *rest = ctx.saved_tensors
    it = iter(rest)
    freqs, positions = (next(it) if has else None for has in ctx.has)
    form, params, skip, height, width, layout, suffix = ctx.spec
    grad_x, grad_freqs = _ops.rope_backward(x, grad_y.contiguous(), form, params, freqs, skip, height, width, layout,
                                            positions, suffix)
    return _masked(ctx, (grad_x, None, None, grad_freqs if freqs is not None and form == "mixed" else None, None, None,
                         None, None, None, None))


torch.library.register_autograd(f"{_lib}::rope_forward", _rope_backward, setup_context=_rope_setup)


@_fake("rope_mixed_init")
def _rope_mixed_init_fake(theta, head_dim, angles):
    return _empty(angles, (2, angles.shape[0], max(head_dim, 0) // 2), torch.float32)


# ---------------------------------------------------------------------------------------------
# ViT tables
# ---------------------------------------------------------------------------------------------

@_fake("table_from_timm")
def _table_from_timm_fake(t):
    return _empty(t, (t.shape[1], t.shape[0]))


@_fake("table_to_timm")
def _table_to_timm_fake(t):
    return _empty(t, (t.shape[1], t.shape[0]))


def _no_setup(ctx, inputs, output):
    pass


def _from_timm_backward(ctx, g):
    _first_order()
    return _ops.table_to_timm(g.contiguous())


def _to_timm_backward(ctx, g):
    _first_order()
    return _ops.table_from_timm(g.contiguous())


torch.library.register_autograd(f"{_lib}::table_from_timm", _from_timm_backward, setup_context=_no_setup)
torch.library.register_autograd(f"{_lib}::table_to_timm", _to_timm_backward, setup_context=_no_setup)


def _window_buckets(window_h, window_w):
    return (2 * window_h - 1) * (2 * window_w - 1)


@_fake("cpb_table")
def _cpb_table_fake(raw, window_h, window_w, sigmoid16):
    return _empty(raw, (raw.shape[1], _window_buckets(window_h, window_w)))


@_fake("cpb_table_backward")
def _cpb_table_backward_fake(raw, grad_table, window_h, window_w, sigmoid16):
    return _empty(raw, raw.shape)


@_fake("cpb_bias_forward")
def _cpb_bias_forward_fake(raw, window_h, window_w, sigmoid16):
    n = window_h * window_w
    return _empty(raw, (1, raw.shape[1], n, n))


@_fake("cpb_bias_backward")
def _cpb_bias_backward_fake(raw, grad_out, window_h, window_w, sigmoid16):
    return _empty(raw, raw.shape)


def _cpb_setup(ctx, inputs, output):
    raw, *spec = inputs
    ctx.spec = spec
    ctx.save_for_backward(raw)


def _cpb_backward_with(op):
    def backward(ctx, g):
        _first_order()
        (raw,) = ctx.saved_tensors
        return _masked(ctx, (op(raw, g.contiguous(), *ctx.spec), None, None, None))
    return backward


torch.library.register_autograd(f"{_lib}::cpb_table", _cpb_backward_with(_ops.cpb_table_backward),
                                setup_context=_cpb_setup)
torch.library.register_autograd(f"{_lib}::cpb_bias_forward", _cpb_backward_with(_ops.cpb_bias_backward),
                                setup_context=_cpb_setup)


@_fake("resize_rel_pos")
def _resize_rel_pos_fake(rel_pos, length):
    return _empty(rel_pos, (length, rel_pos.shape[1]))


@_fake("resize_rel_pos_backward")
def _resize_rel_pos_backward_fake(grad_out, in_length):
    return _empty(grad_out, (in_length, grad_out.shape[1]))


def _resize_setup(ctx, inputs, output):
    ctx.in_length = inputs[0].shape[0]


def _resize_backward(ctx, g):
    _first_order()
    return _masked(ctx, (_ops.resize_rel_pos_backward(g.contiguous(), ctx.in_length), None))


torch.library.register_autograd(f"{_lib}::resize_rel_pos", _resize_backward, setup_context=_resize_setup)


def _decomposed_buckets(height, width, skip):
    return 2 * max(height, width) - 1 + (1 if skip > 0 else 0)


@_fake("decomposed_tables")
def _decomposed_tables_fake(rel_pos_h, rel_pos_w, height, width, skip, unscaled_query):
    k = _decomposed_buckets(height, width, skip)
    c = rel_pos_h.shape[1]
    return [_empty(rel_pos_h, (1, c, k)), _empty(rel_pos_h, (1, c, k))]


@_fake("decomposed_tables_backward")
def _decomposed_tables_backward_fake(g0, g1, length_h, length_w, height, width, skip, unscaled_query):
    return [_empty(g0, (length_h, g0.shape[1])), _empty(g0, (length_w, g0.shape[1]))]


def _decomposed_setup(ctx, inputs, output):
    rel_pos_h, rel_pos_w, height, width, skip, unscaled = inputs
    ctx.spec = (height, width, skip, unscaled)
    ctx.lengths = (rel_pos_h.shape[0], rel_pos_w.shape[0])


def _decomposed_backward(ctx, grads):
    _first_order()
    g0, g1 = grads
    ref = g0 if g0 is not None else g1
    g0 = g0.contiguous() if g0 is not None else torch.zeros_like(ref)
    g1 = g1.contiguous() if g1 is not None else torch.zeros_like(ref)
    height, width, skip, unscaled = ctx.spec
    gh, gw = _ops.decomposed_tables_backward(g0, g1, ctx.lengths[0], ctx.lengths[1], height, width, skip, unscaled)
    return _masked(ctx, (gh, gw, None, None, None, None))


torch.library.register_autograd(f"{_lib}::decomposed_tables", _decomposed_backward, setup_context=_decomposed_setup)


# ---------------------------------------------------------------------------------------------
# The backward operators: not differentiable (a clear error instead of a missing formula)
# ---------------------------------------------------------------------------------------------

def _not_twice(name):
    def backward(ctx, *grads):
        raise RuntimeError(f"[rpe.torch] rpe::{name} has no derivative: the rpe_torch operators are differentiable "
                           "once (a double backward, e.g. a gradient penalty, is not supported)")
    return backward


for _name in ("term_backward", "attention_backward", "rope_backward", "cpb_table_backward", "cpb_bias_backward",
              "resize_rel_pos_backward", "decomposed_tables_backward"):
    torch.library.register_autograd(f"{_lib}::{_name}", _not_twice(_name), setup_context=_no_setup)


# ---------------------------------------------------------------------------------------------
# Autocast (CPU and CUDA)
# ---------------------------------------------------------------------------------------------

_LOW = (torch.bfloat16, torch.float16)
_autocast_lib = torch.library.Library(_lib, "IMPL")

#: The forward operators with bfloat16 and float16 CPU kernels (rpe::bf16 / rpe::f16 storage,
#: ops.cpp), each with the indices of its floating arguments that are not cast to the autocast
#: dtype under bfloat16 / float16 autocast: the
#: RoPE's real-valued per-token positions (the library reads them in float32) and the iRPE terms'
#: integer positions (left as given, so that a wrong dtype keeps its own message); for the
#: attention operators, their list ``indices`` (ATTENTION_INDEX_ARG), which holds both.
BF16_OPS = {"term_forward": (11, 12), "attention_forward": (ATTENTION_INDEX_ARG,),
            "attention_forward_attn": (ATTENTION_INDEX_ARG,),
            "rope_forward": (8,), "table_from_timm": (), "table_to_timm": ()}
#: The same operators, float16 on the CPU (rpe::f16 storage: computed in float, rounded once).
F16_OPS = BF16_OPS

#: The forward operators with float16 and bfloat16 CUDA kernels (ops_cuda.cpp over rpe's CUDA
#: backend: fp16 / bf16 storage, sums in float32), with the arguments left as given (as
#: BF16_OPS). attention_forward_attn has no CUDA kernel (NotImplementedError, cast or not).
CUDA_LOW_OPS = {"term_forward": (11, 12), "attention_forward": (ATTENTION_INDEX_ARG,),
                "attention_forward_attn": (ATTENTION_INDEX_ARG,),
                "rope_forward": (8,)}

#: (device type, autocast dtype) -> the operators that run in that dtype's own kernel under
#: autocast, with the arguments they leave as given; every other operator computes in float32.
#: On CUDA the table operators run their CPU kernel on the host (bf16: table_from_timm /
#: table_to_timm only, exact transposes).
LOW_PRECISION_KERNELS = {
    ("cpu", torch.bfloat16): BF16_OPS,
    ("cpu", torch.float16): F16_OPS,
    ("cuda", torch.float16): CUDA_LOW_OPS,
    ("cuda", torch.bfloat16): {**CUDA_LOW_OPS, "table_from_timm": (), "table_to_timm": ()},
}


def _cast(value, dtype, from_dtypes):
    """value with every tensor of a dtype in from_dtypes cast to dtype (lists / tuples walked)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.dtype in from_dtypes else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype, from_dtypes) for v in value)
    return value


def _cast_args(args, dtype, from_dtypes, keep=()):
    """_cast of each positional argument, except those at the indices in keep (left as given)."""
    return tuple(a if i in keep else _cast(a, dtype, from_dtypes) for i, a in enumerate(args))


def autocast_compute_dtype(name, device_type, dtype):
    """The dtype operator ``name`` computes in under ``torch.autocast(device_type, dtype)``:
    ``dtype`` itself when the device has a kernel of it for the operator
    (:data:`LOW_PRECISION_KERNELS`), else float32 (the up-cast)."""
    return dtype if name in LOW_PRECISION_KERNELS.get((device_type, dtype), {}) else torch.float32


def _autocast_call(op, name, device_type, dtype, args):
    """Operator op (``name``) under autocast of ``device_type`` and ``dtype``, called with the
    autocast key already excluded: see :func:`_register_autocast`."""
    keep = LOW_PRECISION_KERNELS.get((device_type, dtype), {}).get(name)
    if keep is not None:  # the dtype's own kernel: float32 / the other low dtype cast to it
        others = tuple(t for t in (torch.float32, *_LOW) if t != dtype)
        return op(*_cast_args(args, dtype, others, keep))
    out = op(*_cast(args, torch.float32, _LOW))  # up-cast: float32 kernel, float32 sums
    return _cast(out, dtype, (torch.float32,))


def _register_autocast(name, device_type):
    """Under ``torch.autocast(device_type)``, operator ``name`` runs in the autocast dtype's kernel
    or, without one, in float32 (:func:`autocast_compute_dtype`):

    - the device has a kernel of the autocast dtype for the operator (:data:`LOW_PRECISION_KERNELS`:
      CPU bfloat16 and float16, rpe::bf16 / rpe::f16 storage; CUDA float16 and bfloat16, rpe's CUDA fp16 / bf16
      storage; both compute in float and round each output once): its floating inputs in float32
      or the other low-precision dtype are cast to the autocast dtype (as autocast casts a
      Linear's weights; the RoPE positions excepted), that kernel runs and its outputs are
      returned in the autocast dtype;
    - otherwise (an operator without a kernel of that dtype, e.g. the CPB / SAM tables) floating inputs in float16 / bfloat16 / float32 are up-cast to
      float32, the float32 kernel accumulates in float32, and the float32 outputs are returned in
      the autocast dtype (``torch.get_autocast_dtype``), as PyTorch's lower-precision autocast
      ops do.

    float64 inputs are left alone in both (as autocast does). The casts are ordinary
    differentiable ops: gradients reach the inputs in their own dtypes (float32 parameters get
    float32 gradients). Registered for the C++ dispatcher (``Autocast<device>`` key) and the
    Python dispatcher (torch.compile, export)."""
    op = getattr(_ops, name).default
    key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    key = getattr(torch._C.DispatchKey, key_name)

    def run(*args):
        dtype = torch.get_autocast_dtype(device_type)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return _autocast_call(op, name, device_type, dtype, args)

    if op.has_kernel_for_dispatch_key(key):
        op.py_kernels.pop(key, None)
    op.py_impl(key)(run)  # the Python dispatcher (torch.compile, export) takes this one
    _autocast_lib.impl(name, lambda keyset, *args: run(*args), key_name, with_keyset=True)


#: The forward operators that take floating tensors: autocast casts around them.
AUTOCAST_OPS = ("term_forward", "attention_forward", "attention_forward_attn", "rope_forward", "table_from_timm",
                "table_to_timm", "cpb_table", "cpb_bias_forward", "resize_rel_pos", "decomposed_tables")
#: The device types whose autocast has these rules.
AUTOCAST_DEVICES = ("cpu", "cuda")
for _name in AUTOCAST_OPS:
    for _device in AUTOCAST_DEVICES:
        _register_autocast(_name, _device)
