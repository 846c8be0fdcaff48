"""rpe_torch: rpe's iRPE (Wu et al., ICCV 2021) for PyTorch, a drop-in for the reference's irpe.py.

Code written for the reference module (microsoft/Cream ``iRPE/DeiT-with-iRPE/irpe.py``) runs
unchanged with ``import rpe_torch as irpe``: ``METHOD``, ``get_rpe_config``,
``get_single_rpe_config``, ``build_rpe`` and the modules ``iRPE`` / ``iRPE_Cross`` have the
reference's signatures, defaults, parameter names and shapes, so reference checkpoints load with
``load_state_dict(strict=True)``. The work is done by rpe's C++ kernels (operators
``torch.ops.rpe.*``, CPU), with bucket ids from rpe's shared cache (no (L, L) int64 tensor).

``rpe_torch.attention`` runs the whole attention step of the reference (iRPE on q, k, v, key
padding and additive masks) through rpe's fused kernels, differentiable in q, k, v and every table.

The vision-transformer encodings (``rpe_torch.vit``, re-exported here): 2D RoPE (``RoPEAxial``,
``RoPEMixed``, ``RoPECat``, ``RoPEDinoV3``, ``RoPEMRoPE``; layout pairs or rotate-half, grid or
per-token positions; V-JEPA 2's 3D ``RoPEVJEPA2`` in its own layout; ``attention(rope=...,
positions=...)``), Swin / BEiT relative position bias
(``RelPosBias``, timm's table layout), SwinV2's CPB (``relative_log_coords``, ``cpb_table``,
``cpb_bias``), SAM's decomposed relative position (``DecomposedRelPos``, ``resize_rel_pos``) and
2D ALiBi (``ALiBi2D``).

The operator library is found at ``$RPE_TORCH_OPS``, else next to this package, else in
``<repo>/build/bindings/torch/`` (the default CMake build folder). See docs/torch.md.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

__all__ = [
    "METHOD", "families", "load_plugin", "get_num_buckets", "get_single_rpe_config", "get_rpe_config", "build_rpe",
    "iRPE", "iRPE_Cross", "attention", "term", "bucket_ids", "library_path", "set_cache_budget", "cache_stats",
    "clear_caches", "has_cuda_kernels",
    "RoPEAxial", "RoPEMixed", "RoPECat", "RoPEDinoV3", "RoPEMRoPE", "RoPEVJEPA2", "rope", "RelPosBias", "table_from_timm",
    "table_to_timm",
    "relative_log_coords", "cpb_table", "cpb_bias", "DecomposedRelPos", "decomposed_rel_pos", "resize_rel_pos",
    "ALiBi2D", "alibi_slopes", "TermSlot",
]


def _find_library() -> str:
    names = ["librpe_torch_ops.so", "librpe_torch_ops.dylib", "rpe_torch_ops.dll"]
    env = os.environ.get("RPE_TORCH_OPS")
    if env:
        if not os.path.isfile(env):
            raise ImportError(f"rpe_torch: RPE_TORCH_OPS = '{env}' is not a file; expected the path of librpe_torch_ops.so")
        return env
    here = Path(__file__).resolve().parent
    for folder in (here, here.parents[2] / "build" / "bindings" / "torch"):
        for name in names:
            if (folder / name).is_file():
                return str(folder / name)
    raise ImportError("rpe_torch: librpe_torch_ops.so not found; build it with "
                      "`cmake -S . -B build && cmake --build build --target rpe_torch_ops` "
                      "or set RPE_TORCH_OPS to its path")


library_path = _find_library()
torch.ops.load_library(library_path)
_ops = torch.ops.rpe


# Read once, when the library is loaded (its kernels are registered then): a plain bool, so that
# torch.compile traces the device checks without calling the dispatcher query (a graph break).
_HAS_CUDA_KERNELS = bool(torch._C._dispatch_has_kernel_for_dispatch_key("rpe::term_forward", "CUDA"))


def has_cuda_kernels():
    """True when the loaded operator library has rpe_torch's CUDA kernels (built with CMake option
    RPE_TORCH_CUDA: a CUDA-enabled torch and nvcc of the same CUDA major version): then the
    term, attention and RoPE operators take CUDA tensors (float32, float64, float16, bfloat16).
    Says nothing about a device being present (``torch.cuda.is_available()``). Read when the
    library was loaded."""
    return _HAS_CUDA_KERNELS


from . import _registrations  # noqa: E402,F401  (fake kernels, autograd formulas, autocast of the operators)
from . import _onnx  # noqa: E402  (torch.onnx.export: the terms and the attention from standard operators)


class METHOD:
    """The reference's method ids (``irpe.METHOD``): EUCLIDEAN 0, QUANT 1, PRODUCT 3, CROSS 4, and
    the ids of Cross's two sub-modules, CROSS_ROWS 41 and CROSS_COLS 42."""
    EUCLIDEAN = 0
    QUANT = 1
    PRODUCT = 3
    CROSS = 4
    CROSS_ROWS = 41
    CROSS_COLS = 42


# method id -> rpe's mapping name, from rpe's registry (the C++ library names them: group "irpe" is
# the reference's four in the order euclidean, quantization, cross, product); Cross's rows / cols
# sub-modules are Cross with one table.
_IRPE = list(_ops.families("irpe", False))
_METHOD_NAMES = {METHOD.EUCLIDEAN: _IRPE[0], METHOD.QUANT: _IRPE[1], METHOD.CROSS: _IRPE[2], METHOD.PRODUCT: _IRPE[3],
                 METHOD.CROSS_ROWS: _IRPE[2], METHOD.CROSS_COLS: _IRPE[2]}
_METHOD_IDS = {name: method for method, name in _METHOD_NAMES.items() if method < 10}


def set_cache_budget(nbytes):
    """Sets the byte budget of rpe's process-wide host caches (the bucket ids of each grid and
    configuration, the fixed RoPE forms' cos/sin tables): past it, the least recently used entries
    are dropped (and rebuilt, with the same values, when used again). Default 64 MiB each, or
    ``RPE_CACHE_BUDGET_MB`` MiB from the environment; 0 keeps nothing between calls."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"nbytes = {nbytes}; expected >= 0")
    _ops.set_cache_budget(nbytes)


def cache_stats():
    """Counters and holdings of rpe's host caches, for monitoring a long-lived process:
    ``{"bucket_ids": {...}, "rope_tables": {...}}``, each with ``hits``, ``misses``,
    ``evictions``, ``entries``, ``bytes`` and ``budget``."""
    v = list(_ops.cache_stats())
    keys = ("hits", "misses", "evictions", "entries", "bytes", "budget")
    return {"bucket_ids": dict(zip(keys, v[:6])), "rope_tables": dict(zip(keys, v[6:12]))}


def clear_caches():
    """Drops every entry of rpe's host caches and resets their counters (budgets stay)."""
    _ops.clear_caches()


def families(group="", aliases=False):
    """The names of rpe's mapping families (the C++ registry, <rpe/families.hpp>): every one, or
    those of ``group`` ("irpe", "irpe_paper", "1d", "3d", "vit", "user"), with each one's aliases
    after it when ``aliases``. A library loaded with ``torch.ops.load_library`` that registers its
    own mapping (RPE_REGISTER_MAPPING, docs/custom_mapping.md) adds its name here, and the name
    then works as ``method`` of :func:`term`, :func:`bucket_ids` and the operators."""
    return list(_ops.families(group, aliases))


def load_plugin(path):
    """Loads a shared library that registers its own mapping families (RPE_REGISTER_MAPPING,
    docs/custom_mapping.md) with ``torch.ops.load_library`` and checks that rpe's registry took
    them: a name or alias already taken raises ``ValueError`` naming the file and the clash
    (``[rpe.torch] plugin = '...' cannot be loaded: [rpe.registry] name = 'euc'; already registered
    (euclidean)``); the registry keeps working without the refused family. A plain
    ``torch.ops.load_library`` of such a library raises the same ``[rpe.registry]`` message from
    the next rpe operator instead."""
    _ops.families("", False)  # a refusal recorded before this library is not blamed on it
    torch.ops.load_library(path)
    try:
        _ops.families("", False)  # throws, once, the refusals recorded while the library loaded
    except ValueError as e:
        raise ValueError(f"[rpe.torch] plugin = '{path}' cannot be loaded: {e}") from None


class RPEConfig(dict):
    """A dict whose keys are also attributes (what the reference's ``easydict.EasyDict`` gives)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self[name] = value


def _method_name(method) -> str:
    if method not in _METHOD_NAMES:
        raise ValueError(f"[rpe.torch] method = {method!r}; expected a METHOD id: "
                         "0 (EUCLIDEAN), 1 (QUANT), 3 (PRODUCT), 4 (CROSS), 41 or 42 (Cross rows / cols)")
    return _METHOD_NAMES[method]


def get_num_buckets(method, alpha, beta, gamma):
    """Buckets per table without the extra skip bucket, as the reference's ``get_num_buckets``:
    (2·int(beta)+1)² for Product, 2·int(beta)+1 otherwise.

    Raises ValueError (``[rpe.term_spec] ...``) for an unknown method or invalid alpha, beta, gamma.
    """
    return int(_ops.num_buckets(_method_name(method), float(alpha), float(beta), float(gamma), 0))


def get_single_rpe_config(ratio=1.9, method=METHOD.PRODUCT, mode="contextual", shared_head=True, skip=0):
    """The config of one iRPE term, as the reference's ``get_single_rpe_config``: fields
    shared_head, mode, method, alpha = ratio, beta = 2·ratio, gamma = 8·ratio, num_buckets (+1 when
    skip > 0); rpe_torch adds ``skip`` (used to infer square grids; the reference does not store it).

    Raises ValueError for a bad ratio, method, mode or skip.
    """
    if mode not in (None, "bias", "contextual"):
        raise ValueError(f"[rpe.torch] mode = {mode!r}; expected None, 'bias' or 'contextual' (or 'ctx' in get_rpe_config)")
    if not isinstance(skip, int) or isinstance(skip, bool) or skip < 0:
        raise ValueError(f"[rpe.torch] skip = {skip!r}; expected an int >= 0")
    config = RPEConfig()
    config.shared_head = shared_head
    config.mode = mode
    config.method = method
    config.alpha = 1 * ratio
    config.beta = 2 * ratio
    config.gamma = 8 * ratio
    config.num_buckets = get_num_buckets(method, config.alpha, config.beta, config.gamma)
    if skip > 0:
        config.num_buckets += 1
    config.skip = skip
    return config


def get_rpe_config(ratio=1.9, method=METHOD.PRODUCT, mode="contextual", shared_head=True, skip=0, rpe_on="k"):
    """The configs of iRPE on queries, keys and values, as the reference's ``get_rpe_config``.

    ``method``: a METHOD id or a name of rpe's registry group "irpe" (euclidean/euc, quantization/quant, cross, product); ``mode``: "bias",
    "contextual" or "ctx"; ``rpe_on``: letters of "qkv". Returns a config with ``rpe_q``, ``rpe_k``,
    ``rpe_v`` (each a get_single_rpe_config result, or None).
    Raises ValueError for an unknown method name or mode, or a bad rpe_on.
    """
    if isinstance(method, str):
        names = [n for n in families("irpe", True)]
        if method.lower() not in names:
            raise ValueError(f"[rpe.torch] method = {method!r}; expected one of {', '.join(names)} or a METHOD id")
        method = _METHOD_IDS[_ops.family_name(method.lower())]
    if mode == "ctx":
        mode = "contextual"
    if not isinstance(rpe_on, str) or not set(rpe_on) <= set("qkv"):
        raise ValueError(f"[rpe.torch] rpe_on = {rpe_on!r}; expected letters of 'qkv' such as 'k' or 'qkv'")
    kwargs = dict(ratio=ratio, method=method, mode=mode, shared_head=shared_head, skip=skip)
    config = RPEConfig()
    config.rpe_q = get_single_rpe_config(**kwargs) if "q" in rpe_on else None
    config.rpe_k = get_single_rpe_config(**kwargs) if "k" in rpe_on else None
    config.rpe_v = get_single_rpe_config(**kwargs) if "v" in rpe_on else None
    return config


def build_rpe(config, head_dim, num_heads):
    """The iRPE modules [on queries, on keys, on values] (None where unused), as the reference's
    ``build_rpe``; ``config`` from get_rpe_config (this package's or the reference's)."""
    if config is None:
        return None, None, None
    rpes = [config.rpe_q, config.rpe_k, config.rpe_v]
    transposeds = [True, True, False]

    def single(rpe, transposed):
        if rpe is None:
            return None
        cls = iRPE if rpe.method != METHOD.CROSS else iRPE_Cross
        return cls(head_dim=head_dim, num_heads=1 if rpe.shared_head else num_heads, mode=rpe.mode, method=rpe.method,
                   transposed=transposed, num_buckets=rpe.num_buckets, rpe_config=rpe)

    return [single(rpe, transposed) for rpe, transposed in zip(rpes, transposeds)]


def _grid(L, config, num_buckets, height, width, base):
    """(skip, height, width) for a sequence of L tokens; infers a square grid when both are None.
    ``base``: the table's buckets without the extra skip bucket (computed once per module)."""
    L = int(L)  # a plain int also under torch.jit.trace, where sizes are traced values
    if (height is None) != (width is None):
        raise ValueError(f"[rpe.torch] height = {height!r}, width = {width!r}; give both or neither (a square grid)")
    has_extra = num_buckets == base + 1
    known_skip = config.get("skip") if isinstance(config, dict) else None
    if height is None:
        if known_skip is not None:
            side = math.isqrt(max(L - known_skip, 0))
            if L - known_skip < 1 or side * side != L - known_skip:
                raise ValueError(f"[rpe.torch] L = {L} is not skip + a square (skip = {known_skip}); "
                                 "pass height and width for a rectangular grid")
        else:
            side = math.isqrt(L)
        height = width = side
    if not (isinstance(height, int) and isinstance(width, int)) or height < 1 or width < 1:
        raise ValueError(f"[rpe.torch] height = {height!r}, width = {width!r}; expected ints >= 1")
    skip = L - height * width
    if skip < 0:
        raise ValueError(f"[rpe.torch] L = {L} < height*width = {height}*{width}; expected L = skip + height*width")
    if known_skip is not None and skip != known_skip:
        raise ValueError(f"[rpe.torch] L = {L} = skip {skip} + {height}*{width}, but the term was configured with "
                         f"skip = {known_skip}; expected L = {known_skip} + height*width")
    if (skip > 0) != has_extra:
        raise ValueError(f"[rpe.torch] L = {L} = skip {skip} + {height}*{width}, but the table has {num_buckets} buckets, "
                         f"{'with' if has_extra else 'without'} the extra bucket of skip tokens; "
                         "pass the grid's height and width")
    return skip, height, width


def _known_skip(config, num_buckets, base, skip, what):
    """Checks a term's skip tokens ``skip`` (given by per-token positions or packed lengths,
    described by ``what``) against its config's ``skip`` and its table's extra bucket; returns skip."""
    has_extra = num_buckets == base + 1
    known = config.get("skip") if isinstance(config, dict) else None
    if skip < 0:
        raise ValueError(f"[rpe.torch] {what} gives skip = {skip}; expected >= 0 extra tokens")
    if known is not None and skip != known:
        raise ValueError(f"[rpe.torch] {what} gives skip = {skip}, but the term was configured with skip = {known}")
    if (skip > 0) != has_extra:
        raise ValueError(f"[rpe.torch] {what} gives skip = {skip}, but the table has {num_buckets} buckets, "
                         f"{'with' if has_extra else 'without'} the extra bucket of skip tokens")
    return skip


def _check_index(name, t, x=None, axes=None, what="integer tensor", xname="x"):
    """An integer index tensor of the iRPE terms (per-token positions, packed lengths / grids /
    positions, key lengths): None, or an int32 / int64 tensor (rank 2, axes 2 or 3 when ``axes``,
    rank 1 otherwise) on the CPU, or with CUDA tensors (has_cuda_kernels()) on the CPU or the
    device of ``x`` (named ``xname`` in the messages). TypeError / ValueError naming the argument;
    the values (ranges, sums, counts) are the library's checks."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"[rpe.torch] {name} is a {type(t).__name__}; expected a torch.Tensor ({what})")
    device = t.device if t.device.type != "cpu" else (x.device if x is not None else t.device)
    if device.type == "cuda" and has_cuda_kernels():
        if t.device.type != "cpu" and x is not None and t.device != x.device:
            raise ValueError(f"[rpe.torch] {name} is on device {t.device}; expected cpu or {x.device}, the device of the "
                             "other tensors")
    elif device.type != "cpu":
        other = f"{xname}'s device" if x is not None else "the tables' device"
        # the index tensor itself off the CPU, or on the CPU with x on another device than cuda
        where = f"is on device {t.device}" if t.device.type != "cpu" else f"is given with {xname} on device {device}"
        if has_cuda_kernels():
            raise ValueError(f"[rpe.torch] {name} {where}; expected cpu, or {other} when that is cuda ({what})")
        raise ValueError(f"[rpe.torch] {name} {where}; expected cpu ({what}; "
                         f"{other} when that is cuda needs the CUDA kernels, which this operator library was built "
                         "without: CMake option RPE_TORCH_CUDA)")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"[rpe.torch] {name} has dtype {t.dtype}; expected an integer tensor (int32 or int64) of {what}")
    if axes is not None and (t.dim() != 2 or t.shape[1] not in (2, 3)):
        raise ValueError(f"[rpe.torch] {name} has shape {tuple(t.shape)}; expected (N, 2) {what}, or (N, 3) for a 3D "
                         "mapping")
    if axes is None and t.dim() != 1:
        raise ValueError(f"[rpe.torch] {name} has shape {tuple(t.shape)}; expected a 1-D tensor of {what}")


def _check_term_positions(x, positions, key_positions):
    """The per-token positions of an iRPE term (:func:`term`, the modules' forward): each an
    index tensor (_check_index), and key_positions only with positions. Raises before the grid
    is inferred."""
    _check_index("positions", positions, x, axes=True, what="per-token positions")
    _check_index("key_positions", key_positions, x, axes=True, what="per-token key positions")
    if key_positions is not None and positions is None:
        raise ValueError("[rpe.torch] key_positions is given without positions; expected positions too (the queries')")


def term(x, tables, method, mode, target, alpha, beta, gamma, skip, height, width, positions=None, key_positions=None):
    """One iRPE term, differentiable in ``x`` and ``tables``: the reference module's output.

    ``method``: a mapping family of rpe's registry (:func:`families`: "euclidean", "quantization",
    "cross", "product", "euc", "quant", the paper variants, the ViT ones, a loaded plugin's), or a
    spec text such as "product:index=clip,beta=4";
    ``mode``: "bias" / "contextual"; ``target``: "k" or "q" (both compute the reference module's
    untransposed output ``out[b,h,i,j] = Σ_d x[b,h,i,d]·table[h',d,id(i,j)]``; for "q" with
    ``key_positions`` the rows i are the keys: x = k·s (B, H, L_k, D), out (…, L_k, L), id(i, j)
    the id of the key's offset from the query, kpos_i − qpos_j, the transpose of the attention's
    query target (``torch.ops.rpe.term_forward`` with "q" gives the (…, L, L_k) orientation)) or "v".
    Shapes: x (B, H, L, D) for q/k, (B, H, L, L) for v, unused (None) for bias; tables [(Ht, K)]
    bias, [(Ht, D, K)] q/k, [(Ht, K, D)] v, two for cross. Returns (1, Ht, L, L), (B, H, L, L)
    or (B, H, L, D). ``positions``: the tokens' integer positions instead of the grid, (N, 2)
    (row, col) or (N, 3) (t, row, col) for a 3D mapping, L = skip + N (height, width are then not
    read), on the CPU (or, with CUDA tensors, the CPU or their device), not differentiated; ``key_positions``: the keys', (N_k, 2 or 3),
    default the queries' (docs/positions.md); N_k ≠ N (CPU): (L, L_k) ids, L_k = skip + N_k, so
    the output is (…, L, L_k) for "k" (x (B, H, L, D)), (…, L_k, L) for "q" (x (B, H, L_k, D)), and
    x is (B, H, L, L_k) for "v". Raises ValueError / TypeError naming the parameter for bad input.
    """
    for i, t in enumerate(tables):  # the float tensors' devices first: an index tensor is not blamed for theirs
        _check_device(f"tables[{i}]", t)
    if x is not None:
        _check_device("x", x)
    _check_term_positions(x, positions, key_positions)
    if (mode == "bias" and x is not None and x.dim() == 4 and tables and tables[0].dim() == 2
            and tables[0].shape[0] not in (1, x.shape[1])):
        raise ValueError(f"[rpe.torch] tables[0] has shape {tuple(tables[0].shape)}; expected ({x.shape[1]}, K) for x "
                         f"with {x.shape[1]} heads, or (1, K) (shared by the heads)")
    if _onnx.exporting():  # torch.onnx.export: standard operators only (docs/torch.md, ONNX export)
        if positions is not None or key_positions is not None:
            raise _onnx.unsupported("positions" if positions is not None else "key_positions")
        return _onnx.term(x if mode != "bias" else None, list(tables), method, mode, "v" if target == "v" else "k",
                          alpha, beta, gamma, skip, height, width)
    if target == "q" and key_positions is not None:  # the keys' rows: the operator's query target, transposed
        return _ops.term_forward(x if mode != "bias" else None, list(tables), method, mode, "q", float(alpha),
                                 float(beta), float(gamma), int(skip), int(height), int(width), positions,
                                 key_positions).transpose(-1, -2)
    if target == "q":
        target = "k"  # the reference module does not know its slot; attention() transposes
    return _ops.term_forward(x if mode != "bias" else None, list(tables), method, mode, target, float(alpha),
                             float(beta), float(gamma), int(skip), int(height), int(width), positions, key_positions)


def bucket_ids(method, alpha, beta, gamma, skip, height, width):
    """The (T, L, L) int32 bucket ids (T = 2 for "cross": rows, cols) from rpe's cache, for
    inspection and tests (the operators never need them as a tensor)."""
    return _ops.bucket_ids(method, float(alpha), float(beta), float(gamma), int(skip), int(height), int(width))


def _check_device(name, t):
    """t is a CPU tensor, or a CUDA one when the library has the CUDA kernels (has_cuda_kernels();
    the ViT table helpers then run on the host, their tensors copied there and back). Tensors of
    one call on different devices are refused by the operators themselves, naming the argument
    (``[rpe.torch] tables_k[0] is on device cpu; expected cuda:0, the device of q``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"[rpe.torch] {name} is a {type(t).__name__}; expected a torch.Tensor")
    if t.device.type == "cpu" or (t.device.type == "cuda" and has_cuda_kernels()):
        return
    if t.device.type == "cuda":
        raise ValueError(f"[rpe.torch] {name} is on device {t.device}; expected cpu (CPU kernels only: this operator "
                         "library was built without its CUDA kernels, CMake option RPE_TORCH_CUDA)")
    raise ValueError(f"[rpe.torch] {name} is on device {t.device}; expected cpu"
                     + (" or cuda" if has_cuda_kernels() else " (CPU kernels only)"))


def _no_initializer(x):
    """The default initializer of iRPE: leaves the zero table (a module-level function, so that
    ``torch.save(model)`` can pickle the module)."""
    return None


class iRPE(nn.Module):
    """Image relative position encoding on queries, keys (transposed=True) or values
    (transposed=False), the reference's ``irpe.iRPE`` with rpe's kernels.

    Parameters (reference names and shapes): ``lookup_table_bias`` (num_heads, num_buckets) for
    bias mode; ``lookup_table_weight`` (num_heads, head_dim, num_buckets) for contextual q/k,
    (num_heads, num_buckets, head_dim) for v; zero-initialised unless ``initializer`` is given.
    num_heads is 1 for tables shared by the heads. Raises NotImplementedError for bias mode on
    values, as the reference.
    """

    def __init__(self, head_dim, num_heads=8, mode=None, method=None, transposed=True, num_buckets=None,
                 initializer=None, rpe_config=None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        if mode not in (None, "bias", "contextual"):
            raise ValueError(f"[rpe.torch] mode = {mode!r}; expected None, 'bias' or 'contextual'")
        self.mode = mode
        if method is None:
            raise ValueError("[rpe.torch] method = None; expected a METHOD id")
        _method_name(method)
        self.method = method
        self.transposed = transposed
        self.num_buckets = num_buckets
        if initializer is None:
            initializer = _no_initializer
        self.initializer = initializer
        self.reset_parameters()
        self.rpe_config = rpe_config
        # buckets without the skip bucket: a plain int, so that forward calls no int-returning operator
        # (torch.jit.trace, torch.compile and export see only tensor operators)
        self._base_buckets = (None if rpe_config is None else
                              get_num_buckets(method, rpe_config.alpha, rpe_config.beta, rpe_config.gamma))

    @torch.no_grad()
    def reset_parameters(self):
        """Creates the lookup table (zeros) and applies the initializer, as the reference."""
        if self.transposed:
            if self.mode == "bias":
                self.lookup_table_bias = nn.Parameter(torch.zeros(self.num_heads, self.num_buckets))
                self.initializer(self.lookup_table_bias)
            elif self.mode == "contextual":
                self.lookup_table_weight = nn.Parameter(torch.zeros(self.num_heads, self.head_dim, self.num_buckets))
                self.initializer(self.lookup_table_weight)
        else:
            if self.mode == "bias":
                raise NotImplementedError("[Error] Bias non-transposed RPE does not exist.")
            elif self.mode == "contextual":
                self.lookup_table_weight = nn.Parameter(torch.zeros(self.num_heads, self.num_buckets, self.head_dim))
                self.initializer(self.lookup_table_weight)

    def _table(self):
        return self.lookup_table_bias if self.mode == "bias" else self.lookup_table_weight

    def _base(self):
        if self.__dict__.get("_base_buckets") is None:  # rpe_config set after construction, or an old pickle
            c = self.rpe_config
            self._base_buckets = get_num_buckets(self.method, c.alpha, c.beta, c.gamma)
        return self._base_buckets

    def _spec(self, L, height, width, skip=None, what=""):
        """(method name, mode, tables, skip, height, width) of this module for L tokens; with
        ``skip`` given (per-token positions, packed sequences: ``what`` says which), that skip,
        checked against the config, and the grid (height, width) as given."""
        if skip is None:
            skip, height, width = _grid(L, self.rpe_config, self.num_buckets, height, width, self._base())
        else:
            skip = _known_skip(self.rpe_config, self.num_buckets, self._base(), skip, what)
        table = self._table()
        if self.method == METHOD.CROSS_ROWS:
            tables = [table, torch.zeros_like(table)]
        elif self.method == METHOD.CROSS_COLS:
            tables = [torch.zeros_like(table), table]
        else:
            tables = [table]
        return _method_name(self.method), self.mode, tables, skip, height, width

    def forward(self, x, height=None, width=None, positions=None, key_positions=None):
        """The encoding for input x (B, H, L, head_dim) — for values, x is the (B, H, L, L)
        attention — on a height × width grid preceded by skip tokens (L = skip + height·width;
        a square grid when both are None), or at per-token integer ``positions`` (N, 2) (row,
        col) (L = skip + N; ``key_positions`` the keys', default the queries'; on the CPU or x's device; see
        :func:`term`). Returns (1, num_heads, L, L) in bias mode,
        (B, H, L, L) contextual on q/k, (B, H, L, head_dim) on v; None when mode is None.
        Raises ValueError for a length that is not skip + height·width or mismatched shapes,
        TypeError for a dtype other than the table's.
        """
        if self.mode is None:
            return None
        _check_device("x", x)
        if x.dim() != 4:
            raise ValueError(f"[rpe.torch] x has shape {tuple(x.shape)}; expected (B, H, L, D) or (B, H, L, L)")
        _check_term_positions(x, positions, key_positions)  # before the grid is inferred from L
        method, mode, tables, skip, height, width = self._spec(x.shape[2], *_at_positions(x.shape[2], height, width,
                                                                                           positions))
        c = self.rpe_config
        return term(x, tables, method, mode, "k" if self.transposed else "v", c.alpha, c.beta, c.gamma, skip, height,
                    width, positions, key_positions)

    def __repr__(self):
        return ('iRPE(head_dim={rpe.head_dim}, num_heads={rpe.num_heads}, mode="{rpe.mode}", method={rpe.method}, '
                'transposed={rpe.transposed}, num_buckets={rpe.num_buckets}, initializer={rpe.initializer}, '
                'rpe_config={rpe.rpe_config})'.format(rpe=self))


class iRPE_Cross(nn.Module):
    """Cross iRPE, the reference's ``irpe.iRPE_Cross``: sub-modules ``rp_rows`` and ``rp_cols``
    (their own tables, method ids 41 and 42); the encoding is their sum, computed in one call."""

    def __init__(self, method, **kwargs):
        super().__init__()
        if method != METHOD.CROSS:
            raise ValueError(f"[rpe.torch] method = {method!r}; iRPE_Cross expects METHOD.CROSS (4)")
        self.rp_rows = iRPE(**kwargs, method=METHOD.CROSS_ROWS)
        self.rp_cols = iRPE(**kwargs, method=METHOD.CROSS_COLS)

    def _spec(self, L, height, width, skip=None, what=""):
        r = self.rp_rows
        if skip is None:
            skip, height, width = _grid(L, r.rpe_config, r.num_buckets, height, width, r._base())
        else:
            skip = _known_skip(r.rpe_config, r.num_buckets, r._base(), skip, what)
        return "cross", r.mode, [r._table(), self.rp_cols._table()], skip, height, width

    def forward(self, x, height=None, width=None, positions=None, key_positions=None):
        """rows + cols encodings of x; shapes and positions as iRPE.forward."""
        r = self.rp_rows
        if r.mode is None:
            return None
        _check_device("x", x)
        if x.dim() != 4:
            raise ValueError(f"[rpe.torch] x has shape {tuple(x.shape)}; expected (B, H, L, D) or (B, H, L, L)")
        _check_term_positions(x, positions, key_positions)  # before the grid is inferred from L
        method, mode, tables, skip, height, width = self._spec(x.shape[2], *_at_positions(x.shape[2], height, width,
                                                                                           positions))
        c = r.rpe_config
        return term(x, tables, method, mode, "k" if r.transposed else "v", c.alpha, c.beta, c.gamma, skip, height, width,
                    positions, key_positions)

    def __repr__(self):
        return ('iRPE_Cross(head_dim={rpe.head_dim}, num_heads={rpe.num_heads}, mode="{rpe.mode}", '
                'method={rpe.method}, transposed={rpe.transposed}, num_buckets={rpe.num_buckets}, '
                'initializer={rpe.initializer}, rpe_config={rpe.rpe_config})'.format(rpe=self.rp_rows))


def _at_positions(L, height, width, positions):
    """(height, width, skip, what) for iRPE._spec: with per-token positions (N, A), skip = L − N
    and the grid (1, 1) (not read); else (height, width, None, "")."""
    if positions is None:
        return height, width, None, ""
    n = int(positions.shape[0])
    return 1, 1, int(L) - n, f"positions of {n} tokens for L = {int(L)}"


def _slot(name, m, L, height, width, skip=None, what=""):
    """(method, mode, tables, alpha, beta, gamma, skip, height, width) of an attention slot's
    module, or None when it has no term. ``skip`` given (per-token positions, packed sequences;
    ``what`` says which): that skip, checked against the module's, the grid as given (not read)."""
    if m is None:
        return None
    if isinstance(m, (iRPE, iRPE_Cross)):
        c = m.rp_rows.rpe_config if isinstance(m, iRPE_Cross) else m.rpe_config
        if (m.rp_rows.mode if isinstance(m, iRPE_Cross) else m.mode) is None:
            return None
        method, mode, ts, skip, h, w = m._spec(L, height, width, skip, what)
        return method, mode, ts, float(c.alpha), float(c.beta), float(c.gamma), skip, h, w
    if hasattr(m, "_slot") and skip is not None:
        own = int(getattr(m, "skip", 0))
        if own != skip:
            raise ValueError(f"[rpe.torch] {what} gives skip = {skip}, but {name} has skip = {own}")
        if hasattr(m, "height") and hasattr(m, "width"):  # built for its grid (DecomposedRelPos, ALiBi2D)
            r = m._slot(own + m.height * m.width, None, None)
        else:
            r = m._slot(own + 1, 1, 1)
        return (*r[:7], height, width)
    if hasattr(m, "_slot"):
        return m._slot(L, height, width)
    raise TypeError(f"[rpe.torch] {name} is a {type(m).__name__}; expected an rpe_torch iRPE, iRPE_Cross, RelPosBias, "
                    "DecomposedRelPos, ALiBi2D module or a TermSlot")


def _own_skip(m):
    """The skip tokens a slot's module was built for (iRPE: its config's skip; the ViT modules,
    TermSlot: theirs), or None when unknown."""
    if isinstance(m, iRPE_Cross):
        m = m.rp_rows
    if isinstance(m, iRPE):
        c = m.rpe_config
        return c.get("skip") if isinstance(c, dict) else None
    return getattr(m, "skip", None)


def attention(q, k, v, rpe_q=None, rpe_k=None, rpe_v=None, height=None, width=None, key_padding_mask=None,
              attn_mask=None, scale=None, rope=None, save_attn=None, positions=None, key_positions=None,
              rpe_positions=None, rpe_key_positions=None, packed_lengths=None, packed_grids=None,
              packed_positions=None, key_lengths=None, rope_query_suffix=None):
    """The attention step of the reference's RPEAttention (after the qkv projection, before the
    output projection) through rpe's fused kernels:
    ``qs = q·scale; logits = qs·kᵀ + rpe_k(qs) + rpe_q(k·scale)ᵀ (+ attn_mask)``, padded keys
    −∞, ``a = softmax(logits)``, ``out = a·v + rpe_v(a)``.

    q: (B, H, L, D), k, v: (B, H, L_k, D) (L_k = L in self-attention; any L_k ≥ 1 without
    packing, on the CPU and CUDA: cross-attention, KV caches; masks, key_lengths and the probabilities then follow L_k;
    iRPE terms then need rpe_positions and rpe_key_positions), float32, float64, bfloat16 or float16 (bfloat16 / float16 on the CPU: rpe::bf16 / rpe::f16 storage, computed in float, each output rounded once; on CUDA when has_cuda_kernels()); rpe_q / rpe_k / rpe_v: iRPE or iRPE_Cross
    modules from build_rpe, the ViT term modules RelPosBias, DecomposedRelPos, ALiBi2D or a
    TermSlot (SwinV2's CPB table), or None; height, width: the grid (L = skip + height·width;
    square when None; a ViT term's own grid by default); key_padding_mask: (B, L_k) bool/uint8, true =
    padded key; attn_mask: (L, L_k) additive float (or bool, true = masked), not differentiated;
    scale: default D^-1/2; rope: a RoPEAxial / RoPEMixed / RoPECat / RoPEDinoV3 / RoPEMRoPE /
    RoPEVJEPA2 module (its ``layout``, ``skip`` and ``suffix``): q and k are rotated first (L =
    rope.skip + height·width + rope.suffix; RoPEVJEPA2: rope.skip + grid_depth·height·width +
    rope.suffix) and everything after sees the rotated q and k (the RoPEMixed frequencies get their
    gradient); positions: the rope's per-token (row, col) coordinates of q's (and k's) N = L −
    skip − suffix rotated tokens instead of the grid, (N, 2) integer or float ((N, 3) (t, h, w)
    position ids for RoPEMRoPE, (frame, row, col) for RoPEVJEPA2), on the CPU or q's device (not
    differentiated; read in float32: integer ones beyond |value| = 2^24 are a ValueError naming
    rope_positions / rope_key_positions, the operator's names); key_positions: the keys' own positions, (N_k, 2), N_k = L_k − skip − suffix
    (e.g. another grid, or SAM2's memory keys: the query grid repeated once per frame,
    rpe::rope::repeated_grid_positions; default: the queries'); rope_query_suffix: the queries' own
    trailing unrotated tokens (rpe::rotary_embedding::query_suffix), an int >= 0; None
    (or -1): the module's suffix, which otherwise counts the trailing unrotated tokens of q and k
    alike. SAM2's memory attention passes 0: its object-pointer keys (the module's suffix) are
    unrotated while the queries have none (L = skip + height·width + rope_query_suffix, L_k = skip
    + N_k + suffix) — ``positions`` / ``key_positions`` are the RoPE's only; the iRPE terms take
    their own, ``rpe_positions``: integer (N, 2) (row, col) — (N, 3) (t, row, col) for a 3D
    mapping — positions of the N = L − skip grid tokens instead of the grid (height, width are then
    not read by the terms; a ValueError without an attached term, which alone reads them),
    ``rpe_key_positions`` the keys', (L_k − skip, 2 or 3) (default the queries'; required with
    terms when L_k ≠ L: the terms' ids are then (L, L_k), docs/positions.md);
    packed sequences (several images in one sequence, each attended alone, terms included):
    ``packed_lengths`` (M,) integer tokens per image (each image's own skip tokens first; they sum
    to L) with ``packed_grids`` (M, 2) (height, width) or (M, 3) of each image, or
    ``packed_positions`` (L − M·skip, 2 or 3) every image's positions, image after image (no
    height, width, rope, rpe_positions, key_lengths or save_attn with them); ``key_lengths``
    (B,) integer, the index after each batch element's last valid key (keys at index >=
    key_lengths[b] are padding, as key_padding_mask marks them, and are skipped; with a mask, a key
    is padded when either marks it, so take it from the mask: last valid index + 1); these are integer tensors on the CPU
    (or, with CUDA tensors, the CPU or q's device), not differentiated (docs/positions.md); save_attn: keep the (B, H, L, L_k) probabilities for
    the backward, which then does not recompute them (True / False; None: on the CPU when they take
    at most 64 MiB (reading them back is faster than recomputing them), e.g. DeiT-S at batch 64 in
    float32; kept only when a backward can follow, except under
    torch.jit.trace, whose graph must hold one operator in every grad mode: there the choice is the
    shapes' only, eager's in grad mode; pass False for a trace meant for inference only). Rows
    whose keys are all masked give zeros (the reference: NaN). Returns (B, H, L, D), differentiable in q, k, v and every table (first
    derivatives only: a backward with create_graph=True through it raises RuntimeError). Raises ValueError / TypeError naming the
    parameter for bad input.
    """
    from .vit import _RoPE, _check_positions
    if save_attn is not None and not isinstance(save_attn, bool):  # bool("no") would keep them
        raise TypeError(f"[rpe.torch] save_attn = {save_attn!r} has type {type(save_attn).__name__}; expected None, True "
                        "or False")
    if rope is None and (positions is not None or key_positions is not None):
        raise ValueError("[rpe.torch] positions / key_positions are given without rope; expected a RoPE module "
                         "(they are the rotary embedding's per-token positions)")
    if rope_query_suffix is not None:
        if not isinstance(rope_query_suffix, int) or isinstance(rope_query_suffix, bool) or rope_query_suffix < -1:
            raise ValueError(f"[rpe.torch] rope_query_suffix = {rope_query_suffix!r}; expected an int >= 0, or None / -1 "
                             "for the rope's suffix")
        if rope is None:
            raise ValueError(f"[rpe.torch] rope_query_suffix = {rope_query_suffix!r} is given without rope; expected a "
                             "RoPE module (it is the rotary embedding's count of the queries' unrotated trailing tokens)")
    for name, t in (("q", q), ("k", k), ("v", v)):  # first: an index tensor is not blamed for their device
        _check_device(name, t)
    axes, names = getattr(rope, "position_axes", 2), getattr(rope, "position_names", None)
    _check_positions("positions", positions, q, axes, names)
    _check_positions("key_positions", key_positions, q, axes, names)
    _check_index("rpe_positions", rpe_positions, q, axes=True, what="per-token iRPE positions", xname="q")
    _check_index("rpe_key_positions", rpe_key_positions, q, axes=True, what="per-token iRPE key positions", xname="q")
    _check_index("packed_lengths", packed_lengths, q, what="tokens per image", xname="q")
    _check_index("packed_grids", packed_grids, q, axes=True, what="per-image grids (height, width)", xname="q")
    _check_index("packed_positions", packed_positions, q, axes=True, what="per-token positions of the packed images",
                 xname="q")
    _check_index("key_lengths", key_lengths, q, what="valid key lengths", xname="q")
    packed = packed_lengths is not None
    if rpe_key_positions is not None and rpe_positions is None:
        raise ValueError("[rpe.torch] rpe_key_positions is given without rpe_positions; expected rpe_positions too "
                         "(the queries')")
    if not packed and (packed_grids is not None or packed_positions is not None):
        raise ValueError(f"[rpe.torch] {'packed_grids' if packed_grids is not None else 'packed_positions'} is given "
                         "without packed_lengths; expected packed_lengths (tokens per image) too")
    if packed:
        for n, given in (("rpe_positions", rpe_positions is not None), ("key_lengths", key_lengths is not None),
                         ("rope", rope is not None), ("height", height is not None), ("width", width is not None),
                         ("save_attn = True", bool(save_attn))):
            if given:
                raise ValueError(f"[rpe.torch] {n} is given with packed_lengths; expected none (packed_grids / "
                                 "packed_positions give each image's layout; RoPE, key lengths and the (L, L) "
                                 "probabilities are not supported with packed sequences)")
    if q.dim() != 4:
        raise ValueError(f"[rpe.torch] q has shape {tuple(q.shape)}; expected (B, H, L, D)")
    L, D = int(q.shape[2]), int(q.shape[3])  # plain ints also under torch.jit.trace
    if D < 1:
        raise ValueError(f"[rpe.torch] q has shape {tuple(q.shape)}; expected D >= 1")
    # the slots' skip when the terms do not run on the grid: None (the grid), an int, or "own"
    index_skip, what = None, ""
    if rpe_positions is not None:
        n = int(rpe_positions.shape[0])
        index_skip, what = L - n, f"rpe_positions of {n} tokens for L = {L}"
    elif packed_positions is not None:
        n, m_images = int(packed_positions.shape[0]), int(packed_lengths.shape[0])
        if m_images < 1 or (L - n) % m_images != 0:
            raise ValueError(f"[rpe.torch] packed_positions has shape {tuple(packed_positions.shape)}; expected "
                             f"(L - M*skip, 2 or 3) rows for L = {L} and M = {m_images} images")
        index_skip, what = (L - n) // m_images, f"packed_positions of {n} tokens for L = {L} and {m_images} images"
    elif packed:
        index_skip = "own"
    methods, modes, params, counts, tables = [], [], [], [], []
    slots = []  # each slot's (method, mode, tables, alpha, beta, gamma, skip, height, width) or None
    grid = None
    for name, m in (("rpe_q", rpe_q), ("rpe_k", rpe_k), ("rpe_v", rpe_v)):
        sk, sk_what = index_skip, what
        if sk == "own" and m is not None:  # packed grids: each image's skip is the term's own
            sk = _own_skip(m)
            if sk is None:  # an iRPE config without skip: from the lengths and grids (eager)
                sk = (L - int(packed_grids.prod(1).sum())) // int(packed_lengths.shape[0])
            sk_what = "packed_lengths"
        slot = _slot(name, m, L, height, width, None if sk == "own" else sk, sk_what)
        slots.append(slot)
        if slot is None:
            methods.append("")
            modes.append("")
            params.extend([0.0, 0.0, 0.0, 0.0])
            counts.append(0)
            continue
        method, mode, ts, alpha, beta, gamma, skip, h, w = slot
        if index_skip is None:  # with positions or packing the terms' grid is not read (the RoPE's, or the one given)
            if grid is not None and grid != (h, w):
                raise ValueError(f"[rpe.torch] {name} infers a {h}x{w} grid, another term {grid[0]}x{grid[1]}; pass height "
                                 "and width")
            grid = (h, w)
        methods.append(method)
        modes.append(mode)
        params.extend([alpha, beta, gamma, float(skip)])
        counts.append(len(ts))
        for i, t in enumerate(ts):  # the operators' names: tables_q[0], ...
            _check_device(f"tables_{name[-1]}[{i}]", t)
        tables.extend(ts)
    if rpe_positions is not None and not any(methods):  # nothing would read them: refused, not ignored
        both = rpe_key_positions is not None
        raise ValueError(f"[rpe.torch] rpe_positions{' and rpe_key_positions are' if both else ' is'} given but no iRPE "
                         "term (rpe_q, rpe_k, rpe_v) is attached; expected none (they are the iRPE terms' per-token "
                         "positions; the RoPE's are positions / key_positions)")
    if _onnx.exporting():  # torch.onnx.export: the step from standard operators (docs/torch.md, ONNX export)
        for n, given in (("rope", rope is not None), ("rpe_positions", rpe_positions is not None),
                         ("packed_lengths", packed), ("key_lengths", key_lengths is not None),
                         ("rope_query_suffix", rope_query_suffix is not None), ("save_attn = True", bool(save_attn)),
                         (f"k with L_k = {int(k.shape[2])} keys for L = {L} queries", int(k.shape[2]) != L)):
            if given:
                raise _onnx.unsupported(n)
        from .vit import ALiBi2D
        for n, m in (("rpe_q", rpe_q), ("rpe_k", rpe_k), ("rpe_v", rpe_v)):  # their tables are parameters or buffers
            if m is not None and not isinstance(m, (iRPE, iRPE_Cross, ALiBi2D)):
                raise _onnx.unsupported(f"{n} = a {type(m).__name__} (its tables come from rpe operators; the iRPE, "
                                        "iRPE_Cross and ALiBi2D modules are composed)")
        return _onnx.attention(q, k, v, slots, key_padding_mask, attn_mask, scale)
    rope_spec, freqs = ("", [], 0, "pairs", 0), None
    if rope is not None:
        if not isinstance(rope, _RoPE):
            raise TypeError(f"[rpe.torch] rope is a {type(rope).__name__}; expected an rpe_torch RoPEAxial, RoPEMixed, "
                            "RoPECat, RoPEDinoV3, RoPEMRoPE or RoPEVJEPA2 module")
        rope._check_head_dim(q, "q")  # a module built for one head_dim refuses another
        # the queries' grid: L less their own suffix (the module's unless rope_query_suffix is given)
        qs = None if rope_query_suffix is None or rope_query_suffix < 0 else rope_query_suffix
        # a V-JEPA 2 clip of several frames: its per-token (frame, row, col) ids as the positions
        rh, rw, positions = rope._grid(L, *(grid if grid is not None and height is None else (height, width)), positions,
                                       suffix=qs)
        form, rope_params, rope_skip, h, w = rope._spec(L, rh, rw, positions, suffix=qs)
        if positions is None:  # the rope's grid (with positions, the terms' grid or none)
            grid = (h, w)
        rope_spec, freqs = (form, rope_params, rope_skip, rope.layout, rope.suffix), rope._freqs()
    if grid is None:
        grid = (height or 1, width or 1) if height is not None else (1, 1)
    if packed:
        grid = (0, 0)  # each image's grid is in packed_grids / packed_positions
    if key_padding_mask is not None:
        _check_device("key_padding_mask", key_padding_mask)
    if attn_mask is not None:
        _check_device("attn_mask", attn_mask)
        if attn_mask.requires_grad and torch.is_grad_enabled():
            raise ValueError("[rpe.torch] attn_mask requires grad; rpe_torch.attention does not differentiate the "
                             "additive mask (pass attn_mask.detach())")
    if freqs is not None:
        _check_device("rope freqs", freqs)
    if q.device.type == "cuda" and save_attn:
        raise ValueError("[rpe.torch] save_attn = True is not supported on CUDA: rpe's CUDA attention keeps no "
                         "(B, H, L, L) probabilities (its backward recomputes them); expected save_attn = None or False")
    tracing = torch.jit.is_tracing()
    if save_attn is None:  # CUDA: never (the CUDA attention has no probabilities output)
        # bytes per saved probability: q's, or 2 under CPU bf16 / float16 autocast of a float32,
        # bf16 or float16 q (the kernel runs in the autocast dtype)
        size = q.element_size()
        if (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
                and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in (torch.bfloat16, torch.float16)):
            size = 2
        # reading them back costs less than the backward's recomputation of the logits and softmax
        # whatever the terms (on a Xeon, DeiT-S shapes, fwd+bwd: 4 % faster without a term, 6 %
        # with a contextual key term, 8-10 % with query terms; docs/torch.md)
        save_attn = (q.device.type == "cpu"
                     and q.shape[0] * q.shape[1] * L * int(k.shape[2]) * size <= 64 << 20)
    # only worth it when a backward can follow; not asked under torch.jit.trace, whose graph holds
    # one operator whatever grad mode it later runs in (check_trace re-traces under no_grad): there
    # the choice is the shapes' only, eager's in grad mode
    save_attn = bool(save_attn) and not packed and (tracing or (torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, *tables, *([freqs] if freqs is not None else [])))))
    # q, k, v are often strided views of a qkv projection: the kernels read them in place when each
    # row of D values is contiguous (last stride 1), else copy them (checked first: no copy of a
    # tensor the kernels refuse)
    a, b, c = counts
    tq, tk, tv = tables[:a], tables[a:a + b], tables[a + b:a + b + c]
    # the operators' grouped arguments (few schema arguments keep torch.library's per-call autograd cost low)
    args = _registrations.attention_op_args(
        q, k, v, tq, tk, tv, methods[0], modes[0], methods[1], modes[1], methods[2], modes[2], params, grid[0], grid[1],
        key_padding_mask, attn_mask, None if scale is None else float(scale), rope_spec[0], rope_spec[1], freqs,
        rope_spec[2], rope_spec[3], positions, key_positions, rope_spec[4], rpe_positions, rpe_key_positions,
        packed_lengths, packed_grids, packed_positions, key_lengths,
        -1 if rope_query_suffix is None else int(rope_query_suffix))
    if save_attn:  # the backward reads the probabilities instead of recomputing them
        return _ops.attention_forward_attn(*args)[0]
    return _ops.attention_forward(*args)


from .vit import (  # noqa: E402  (the ViT encodings use the operators loaded above)
    ALiBi2D, DecomposedRelPos, RelPosBias, RoPEAxial, RoPECat, RoPEDinoV3, RoPEMixed, RoPEMRoPE, RoPEVJEPA2, TermSlot,
    alibi_slopes,
    cpb_bias, cpb_table,
    decomposed_rel_pos, relative_log_coords, resize_rel_pos, rope, table_from_timm, table_to_timm,
)
