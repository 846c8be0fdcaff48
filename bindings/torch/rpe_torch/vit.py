"""rpe_torch's vision-transformer encodings (rpe's C++ kernels, CPU): 2D RoPE (rope-vit's Axial
and Mixed, timm's cat form of EVA-02, DINOv3, Qwen-VL's M-RoPE; channel layout pairs or
rotate-half, on the grid or at per-token positions), V-JEPA 2's 3D RoPE (its own layout), the Swin / BEiT relative position bias (timm's table
layout), SwinV2's continuous position bias (the table from the user's CPB MLP), SAM's decomposed
relative position and CROMA's 2D ALiBi.

Every module and function here is differentiable where the model learns something (x, the RoPE-
Mixed frequencies, the bias tables, the CPB MLP's output, SAM's two tables) and joins
``rpe_torch.attention``: RoPE modules through ``rope=``, the bias / term modules (and
:class:`TermSlot`) as ``rpe_q`` / ``rpe_k`` / ``rpe_v``. The math is the C++ library's
(``torch.ops.rpe.*``, see docs/torch.md); nothing is recomputed in Python.
"""
from __future__ import annotations

import functools
import math
import numbers
import operator

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from . import _check_device, _ops, term

__all__ = [
    "RoPEAxial", "RoPEMixed", "RoPECat", "RoPEDinoV3", "RoPEMRoPE", "RoPEVJEPA2", "rope",
    "RelPosBias", "table_from_timm", "table_to_timm",
    "relative_log_coords", "cpb_table", "cpb_bias",
    "DecomposedRelPos", "decomposed_rel_pos", "resize_rel_pos",
    "ALiBi2D", "alibi_slopes", "TermSlot",
]


def _count(v, name, low=1, high=1 << 30):
    """An int in [low, high] (a head count, head_dim, grid side, length); ValueError / TypeError
    naming the parameter otherwise."""
    if not isinstance(v, numbers.Integral) or isinstance(v, bool):
        raise TypeError(f"[rpe.torch] {name} = {v!r}; expected an int")
    if not low <= v <= high:
        raise ValueError(f"[rpe.torch] {name} = {v}; expected {low} <= {name} <= {high}")
    return int(v)


def _is_int(v):
    """True for a Python, numpy or torch integer (anything with ``__index__``), not a bool."""
    return not isinstance(v, bool) and hasattr(type(v), "__index__")


def _pair(v, name):
    """(rows, cols) from an int or a 2-sequence of ints (Python, numpy or torch integers);
    ValueError otherwise (floats included: they are not truncated)."""
    if _is_int(v):
        v = (v, v)
    if not isinstance(v, (tuple, list)) or len(v) != 2 or not all(_is_int(s) for s in v):
        raise ValueError(f"[rpe.torch] {name} = {v!r}; expected an int or a pair of ints (rows, cols)")
    return operator.index(v[0]), operator.index(v[1])


def _square_grid(L, skip, height, width, suffix=0, suffix_name="suffix", note=""):
    """(height, width) given, or the square grid of L − skip − suffix tokens (``suffix``: the
    trailing unrotated tokens, named ``suffix_name`` in the message, with ``note`` after it)."""
    L = int(L)
    if (height is None) != (width is None):
        raise ValueError(f"[rpe.torch] height = {height!r}, width = {width!r}; give both or neither (a square grid)")
    if height is not None:
        for v, name in ((height, "height"), (width, "width")):
            if not _is_int(v):
                raise TypeError(f"[rpe.torch] {name} = {v!r}; expected an int (rows or cols of the grid)")
        return operator.index(height), operator.index(width)
    n = L - skip - suffix
    side = math.isqrt(max(n, 0))
    if n < 1 or side * side != n:
        if suffix == 0 and suffix_name == "suffix":
            raise ValueError(f"[rpe.torch] L = {L} is not skip + a square (skip = {skip}); pass height and width")
        raise ValueError(f"[rpe.torch] L = {L} is not skip + a square + {suffix_name} (skip = {skip}, {suffix_name} = "
                         f"{suffix}: {n} tokens left for the square grid{note}); expected L = {skip} + side*side + "
                         f"{suffix}, or pass height and width")
    return side, side


# ---------------------------------------------------------------------------------------------
# 2D RoPE
# ---------------------------------------------------------------------------------------------

_LAYOUTS = ("pairs", "half")


def _check_positions(name, positions, x=None, axes=2, what=None):
    """Per-token RoPE positions: None, or an (N, axes) integer / float32 / float64 tensor of
    (row, col) coordinates — (t, h, w) when axes = 3 (M-RoPE), or the module's ``what`` (V-JEPA 2:
    (frame, row, col)) — (the operators convert them to float32, as the library reads them, and
    refuse integer ones beyond |value| = 2^24 there: a data check, not traced by torch.compile), on
    the CPU or on x's device (CUDA: rpe's CUDA backend copies them to the host for its checks and
    tables). ValueError / TypeError naming the argument otherwise."""
    if positions is None:
        return
    if what is None:
        what = "(row, col)" if axes == 2 else "(t, h, w)"
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"[rpe.torch] {name} is a {type(positions).__name__}; expected a torch.Tensor (N, {axes}) of "
                        f"{what} coordinates")
    if x is not None and positions.device.type != "cpu" and positions.device != x.device:
        expected = "cpu" if x.device.type == "cpu" else f"cpu or {x.device}"
        raise ValueError(f"[rpe.torch] {name} is on device {positions.device}; expected {expected}, the device of the "
                         "other tensors")
    if positions.dtype == torch.bool or positions.is_complex() or (positions.is_floating_point()
                                                                  and positions.dtype not in (torch.float32, torch.float64)):
        raise TypeError(f"[rpe.torch] {name} has dtype {positions.dtype}; expected an integer, float32 or float64 tensor "
                        f"of {what} coordinates")
    if positions.dim() != 2 or positions.shape[1] != axes:
        raise ValueError(f"[rpe.torch] {name} has shape {tuple(positions.shape)}; expected (N, {axes}) per-token {what} "
                         "coordinates")


class _RoPE(nn.Module):
    """Base of the RoPE modules: ``forward(x, height=None, width=None, positions=None)`` rotates q
    or k (B, H, L, D): the first ``skip`` tokens (class, register tokens) and the last ``suffix``
    ones stay unrotated; the others sit on a height × width grid (L = skip + height·width +
    suffix; a square grid when both are None) or at ``positions`` (N, 2) (row, col), N = L −
    skip − suffix, in the form's own coordinate frame (integer or real; on the CPU or x's device). ``layout``:
    the channel pairing, ``"pairs"`` (2j, 2j+1) or ``"half"`` (j, j + D/2, rotate-half)."""

    form = ""
    layout = "pairs"  # class defaults: modules pickled before these options load unchanged
    suffix = 0
    position_axes = 2  # columns of per-token positions: (row, col); RoPEMRoPE: (t, h, w)
    position_names = None  # what the columns are, for messages (None: (row, col) or (t, h, w))
    layouts = _LAYOUTS  # the channel layouts the form takes

    def __init__(self, skip=0, layout="pairs", suffix=0):
        super().__init__()
        if not isinstance(skip, int) or isinstance(skip, bool) or skip < 0:
            raise ValueError(f"[rpe.torch] skip = {skip!r}; expected an int >= 0")
        if not isinstance(suffix, int) or isinstance(suffix, bool) or suffix < 0:
            raise ValueError(f"[rpe.torch] suffix = {suffix!r}; expected an int >= 0")
        if layout not in self.layouts:
            raise ValueError(f"[rpe.torch] layout = {layout!r}; expected " + " or ".join(repr(v) for v in self.layouts))
        self.skip, self.layout, self.suffix = skip, layout, suffix

    def _params(self):
        return []

    def _freqs(self):
        return None

    def _check_head_dim(self, x, name="x"):
        """Refuses x (B, H, L, D) whose D the module was not built for (ValueError); a no-op for
        the forms whose tables the operators check against D themselves."""

    def _suffix_names(self, suffix=None):
        """(count, name, note) of the tokens' trailing unrotated count for messages: the module's
        ``suffix``, or the attention's ``rope_query_suffix`` when ``suffix`` is given (then the
        module's counts the keys only)."""
        if suffix is None:
            return self.suffix, "suffix", ""
        return suffix, "rope_query_suffix", f"; the rope's suffix = {self.suffix} counts the keys only"

    def _grid(self, L, height, width, positions=None, suffix=None):
        """(height, width, positions) the operators get for L tokens: as given (a form on a 2D
        grid); RoPEVJEPA2 turns a clip of several frames into its per-token (frame, row, col) ids.
        ``suffix``: the tokens' trailing unrotated count when not the module's (the attention's
        rope_query_suffix)."""
        return height, width, positions

    def _spec(self, L, height, width, positions=None, suffix=None):
        """(form, params, skip, height, width): the grid is not used (1 × 1) with positions; a
        square grid of L − skip − suffix tokens when height, width are None (``suffix``: the
        module's unless given, see _grid)."""
        if positions is not None:
            height, width = 1, 1
        else:
            height, width = _square_grid(L, self.skip, height, width, *self._suffix_names(suffix))
        return self.form, [float(p) for p in self._params()], self.skip, height, width

    def forward(self, x, height=None, width=None, positions=None):
        """The rotated x (B, H, L, D). ``positions``: (N, 2) per-token (row, col) coordinates
        instead of the grid (height, width then unused). Raises ValueError / TypeError with the
        library's message (L ≠ skip + height·width + suffix, D not a multiple of 4 (axial, cat,
        dinov3) or 2 (mixed), bad parameters, positions of the wrong shape, dtype or device)."""
        _check_positions("positions", positions, x, self.position_axes, self.position_names)
        _check_device("x", x)
        if x.dim() != 4:
            raise ValueError(f"[rpe.torch] x has shape {tuple(x.shape)}; expected (B, H, L, D)")
        self._check_head_dim(x)
        return self._rotate(x, *self._grid(x.shape[2], height, width, positions))

    def _rotate(self, x, height, width, positions):
        form, params, skip, height, width = self._spec(x.shape[2], height, width, positions)
        return _ops.rope_forward(x, form, params, self._freqs(), skip, height, width, self.layout, positions, self.suffix)

    def _options_repr(self, default_layout="pairs"):
        return f"skip={self.skip}" + (f", layout={self.layout!r}" if self.layout != default_layout else "") + (
            f", suffix={self.suffix}" if self.suffix else "")


class RoPEAxial(_RoPE):
    """RoPE-Axial of rope-vit (rpe::rope::axial): pair p < D/4 turns by col·f_p, the others by
    row·f_(p−D/4), f_j = θ^(−4j/D); D a multiple of 4. No parameter. Source: naver-ai/rope-vit
    ``compute_axial_cis`` (θ = 100 in its models). ``skip``, ``layout``, ``suffix``: as every RoPE
    module (rope-vit's layout is ``"pairs"``)."""

    form = "axial"

    def __init__(self, theta=100.0, skip=0, layout="pairs", suffix=0):
        super().__init__(skip, layout, suffix)
        self.theta = _theta(theta)

    def _params(self):
        return [self.theta]

    def extra_repr(self):
        return f"theta={self.theta}, {self._options_repr()}"


class RoPEMixed(_RoPE):
    """RoPE-Mixed of rope-vit (rpe::rope::mixed): pair p of head h turns by
    col·fx[h, p] + row·fy[h, p] with the learned ``freqs`` (2, num_heads, head_dim/2) parameter
    ([0] = fx, [1] = fy; rope-vit's ``freqs[:, layer]`` viewed (2, H, D/2)), initialised as
    rope-vit's ``init_random_2d_freqs`` (per-head angles uniform in [0, 2π) when ``rotate``, else
    0; rpe::rope::init_mixed_frequencies). The frequencies get their gradient (also at per-token
    positions, which then take the place of (col, row)). ``skip``, ``layout``, ``suffix``: as
    every RoPE module."""

    form = "mixed"

    def __init__(self, num_heads, head_dim, theta=10.0, skip=0, rotate=True, layout="pairs", suffix=0):
        super().__init__(skip, layout, suffix)
        _count(num_heads, "num_heads")
        if _count(head_dim, "head_dim", 2) % 2:
            raise ValueError(f"[rpe.torch] head_dim = {head_dim}; expected an even number (RoPE-Mixed rotates pairs)")
        # float32 whatever torch's default dtype (rope_mixed_init takes float32 angles)
        angles = (torch.rand(num_heads, dtype=torch.float32) * 2 * math.pi if rotate
                  else torch.zeros(num_heads, dtype=torch.float32))
        self.freqs = nn.Parameter(_ops.rope_mixed_init(_theta(theta), int(head_dim), angles))

    def _freqs(self):
        return self.freqs

    def extra_repr(self):
        return f"num_heads={self.freqs.shape[1]}, head_dim={2 * self.freqs.shape[2]}, {self._options_repr()}"


def _flag(value, name):
    """A boolean parameter: a bool (numpy's too) or the int 0 / 1; TypeError / ValueError naming it
    otherwise (``bool("false")`` is True: a string is refused rather than read so)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, int):
        raise ValueError(f"[rpe.torch] {name} = {value!r}; expected True or False (or 0 / 1)")
    raise TypeError(f"[rpe.torch] {name} is a {type(value).__name__} ({value!r}); expected True or False")


class RoPECat(_RoPE):
    """timm's RotaryEmbeddingCat with apply_rot_embed_cat (rpe::rope::cat; EVA-02's defaults):
    ``temperature``, ``in_pixels``, ``max_res``, ``linear_bands``, ``grid_offset``,
    ``ref_feat_shape`` (None or (rows, cols)), ``grid_indexing`` 'ij' or 'xy'. D a multiple of 4.
    No parameter. ``layout="half"`` is timm's ``half=True`` (rotate-half); per-token positions
    are timm's coordinates after its scaling (rope::cat::angle_at)."""

    form = "cat"

    def __init__(self, temperature=10000.0, in_pixels=False, max_res=224.0, linear_bands=False, grid_offset=0.0,
                 ref_feat_shape=None, grid_indexing="ij", skip=0, layout="pairs", suffix=0):
        super().__init__(skip, layout, suffix)
        if grid_indexing not in ("ij", "xy"):
            raise ValueError(f"[rpe.torch] grid_indexing = {grid_indexing!r}; expected 'ij' or 'xy'")
        self.temperature, self.max_res = _theta(temperature, "temperature"), float(max_res)
        self.in_pixels = _flag(in_pixels, "in_pixels")
        self.linear_bands = _flag(linear_bands, "linear_bands")
        self.grid_offset, self.grid_indexing = float(grid_offset), grid_indexing
        self.ref_feat_shape = None if ref_feat_shape is None else _pair(ref_feat_shape, "ref_feat_shape")

    def _params(self):
        ref = self.ref_feat_shape or (0, 0)
        return [self.temperature, self.in_pixels, self.max_res, self.linear_bands, self.grid_offset, ref[0], ref[1],
                self.grid_indexing == "xy"]

    def extra_repr(self):
        return (f"temperature={self.temperature}, in_pixels={self.in_pixels}, ref_feat_shape={self.ref_feat_shape}, "
                f"grid_indexing={self.grid_indexing!r}, {self._options_repr()}")


_DINOV3_NORMALIZE = {"separate": 0, "max": 1, "min": 2}


_FLOAT32_MAX = 3.4028234663852886e38


def _real(v, name):
    """A finite float within float32's range (the library computes in float32); ValueError naming
    the parameter otherwise."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        raise ValueError(f"[rpe.torch] {name} = {v!r}; expected a finite number")
    if abs(float(v)) > _FLOAT32_MAX:
        raise ValueError(f"[rpe.torch] {name} = {v!r}; expected |{name}| <= {_FLOAT32_MAX:.8g} (the library computes "
                         "in float32)")
    return float(v)


def _theta(v, name="theta"):
    """A frequency base as the library takes it: a number within float32's range (its sign and
    finiteness are the library's checks, whose messages name it); ValueError otherwise."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"[rpe.torch] {name} = {v!r}; expected a number")
    v = float(v)
    if math.isfinite(v) and abs(v) > _FLOAT32_MAX:
        raise ValueError(f"[rpe.torch] {name} = {v!r}; expected |{name}| <= {_FLOAT32_MAX:.8g} (the library computes "
                         "in float32)")
    return v


def _real_pair(v, name):
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        v = (v, v)
    if not isinstance(v, (tuple, list)) or len(v) != 2:
        raise ValueError(f"[rpe.torch] {name} = {v!r}; expected a number or a pair (rows, cols)")
    return _real(v[0], f"{name}[0]"), _real(v[1], f"{name}[1]")


class RoPEDinoV3(_RoPE):
    """DINOv3's RoPE (rpe::rope::dinov3 through ``rope::custom``), with the attribute and buffer
    names of timm's ``RotaryEmbeddingDinoV3`` (``dim``, ``temperature``, ``min_period``,
    ``max_period``, ``normalize_coords``, ``shift_coords``, ``jitter_coords``,
    ``rescale_coords``, ``rotate_half``; the non-persistent buffer ``periods`` (dim/4,)), so a
    timm state dict (which holds none of them) loads with ``strict=True``. ``dim``: the head dim
    (a multiple of 4). Coordinates ``2·(i + 0.5)/n − 1`` per axis (``normalize_coords``
    "separate": n = that axis' size; "max" / "min": the larger / smaller side), then the
    augmentation ``c = ((c + shift)·jitter)·rescale`` with the **already-sampled** values
    ``shift`` (dy, dx), ``jitter`` (fy, fx) and ``rescale`` (attributes, defaults 0, 1, 1 = none;
    :meth:`sample_augmentation` draws them as DINOv3 / timm do in training from the ranges
    ``shift_coords``, ``jitter_coords``, ``rescale_coords``); periods ``temperature^(2k/(dim/2))``
    (DINOv3's ``base``) or, with ``min_period`` and ``max_period``, ``min·(max/min)^linspace(0, 1,
    dim/4)``; angle ``2π·c/period``, rows on pairs j < dim/4. ``layout`` defaults to ``"half"``
    (DINOv3's rotate-half; timm ``rotate_half=False`` is ``"pairs"``); ``skip`` is DINOv3's CLS +
    storage tokens (5 in the released models). Per-token ``positions`` are DINOv3's own
    coordinates, already in its (−1, 1) frame (the augmentation applies to them, the
    normalisation does not). No parameter; nothing is learned. ``periods`` is for inspection: the
    kernels compute the same periods in float32 (rpe::rope::dinov3::period). Source:
    facebookresearch/dinov3 ``dinov3/layers/rope_position_encoding.py``; timm
    ``timm/layers/pos_embed_sincos.py`` RotaryEmbeddingDinoV3."""

    form = "dinov3"

    def __init__(self, dim, temperature=100.0, min_period=None, max_period=None, normalize_coords="separate",
                 shift_coords=None, jitter_coords=None, rescale_coords=None, shift=(0.0, 0.0), jitter=(1.0, 1.0),
                 rescale=1.0, skip=0, layout="half", suffix=0):
        super().__init__(skip, layout, suffix)
        if _count(dim, "dim", 4) % 4:
            raise ValueError(f"[rpe.torch] dim = {dim}; expected a multiple of 4 (DINOv3 splits the pairs over 2 axes)")
        if (min_period is None) != (max_period is None):
            raise ValueError(f"[rpe.torch] min_period = {min_period!r}, max_period = {max_period!r}; give both or neither")
        if min_period is None and temperature is None:
            raise ValueError("[rpe.torch] temperature = None without min_period, max_period; expected one of them")
        if normalize_coords not in _DINOV3_NORMALIZE:
            raise ValueError(f"[rpe.torch] normalize_coords = {normalize_coords!r}; expected 'separate', 'max' or 'min'")
        for name, v, low in (("shift_coords", shift_coords, 0.0), ("jitter_coords", jitter_coords, 1.0),
                             ("rescale_coords", rescale_coords, 1.0)):
            if v is not None and not _real(v, name) >= low:
                raise ValueError(f"[rpe.torch] {name} = {v!r}; expected None or a number >= {low:g}")
        self.dim = int(dim)
        self.temperature = None if temperature is None else float(temperature)
        self.min_period = None if min_period is None else float(min_period)
        self.max_period = None if max_period is None else float(max_period)
        self.normalize_coords = normalize_coords
        self.shift_coords, self.jitter_coords, self.rescale_coords = shift_coords, jitter_coords, rescale_coords
        self.shift, self.jitter, self.rescale = _real_pair(shift, "shift"), _real_pair(jitter, "jitter"), _real(rescale, "rescale")
        self.register_buffer("periods", self._compute_periods(), persistent=False)

    @property
    def rotate_half(self):
        """timm's flag: the layout is ``"half"``."""
        return self.layout == "half"

    def _compute_periods(self):
        """timm's ``_compute_periods`` (float32): the periods the kernels use, for inspection."""
        n = self.dim // 4
        if self.min_period is not None:
            e = torch.linspace(0, 1, n, dtype=torch.float32)
            return self.min_period * ((self.max_period / self.min_period) ** e)
        return self.temperature ** (2.0 * torch.arange(n, dtype=torch.float32) / (self.dim // 2))

    def sample_augmentation(self, generator=None):
        """Draws and sets ``shift``, ``jitter``, ``rescale`` from the ranges ``shift_coords`` (shift
        uniform in [−s, s] per axis), ``jitter_coords`` (exp(uniform(−log J, log J)) per axis) and
        ``rescale_coords`` (one exp(uniform(−log R, log R))), in DINOv3's order and float32, from
        ``generator`` (default: torch's global one, as timm's training step); a range that is None
        leaves its value at the identity. Returns ``(shift, jitter, rescale)``. Call it once per
        training step (and reset with ``m.shift, m.jitter, m.rescale = (0, 0), (1, 1), 1`` for
        evaluation); forward never draws."""
        def uniform(n, bound):
            return torch.empty(n, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
        shift, jitter, rescale = (0.0, 0.0), (1.0, 1.0), 1.0
        if self.shift_coords is not None:
            shift = tuple(uniform(2, float(self.shift_coords)).tolist())
        if self.jitter_coords is not None:
            jitter = tuple(uniform(2, math.log(float(self.jitter_coords))).exp().tolist())
        if self.rescale_coords is not None:
            rescale = uniform(1, math.log(float(self.rescale_coords))).exp().item()
        self.shift, self.jitter, self.rescale = shift, jitter, rescale
        return shift, jitter, rescale

    def _check_head_dim(self, x, name="x"):
        """ValueError when x's D is not ``dim`` (the module's periods are made for it, as timm's)."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"[rpe.torch] {name} has shape {tuple(x.shape)}; expected D = dim = {self.dim} (the "
                             "RoPEDinoV3 module's)")

    def _params(self):
        periods = self.min_period is not None
        return [self.temperature if self.temperature is not None else 100.0, self.min_period if periods else 0.0,
                self.max_period if periods else 0.0, _DINOV3_NORMALIZE[self.normalize_coords], *self.shift,
                *self.jitter, self.rescale]

    @classmethod
    def from_timm(cls, module, skip=0, suffix=0):
        """The RoPEDinoV3 of a timm ``RotaryEmbeddingDinoV3`` (its settings and augmentation ranges;
        no augmentation sampled yet). Raises ValueError for a ``grid_offset`` other than 0 or
        ``grid_indexing`` other than 'ij' (DINOv3 uses neither)."""
        if getattr(module, "grid_offset", 0.0) != 0.0 or getattr(module, "grid_indexing", "ij") != "ij":
            raise ValueError(f"[rpe.torch] module has grid_offset = {module.grid_offset!r}, grid_indexing = "
                             f"{module.grid_indexing!r}; expected 0 and 'ij' (DINOv3's grid)")
        return cls(module.dim, module.temperature, module.min_period, module.max_period, module.normalize_coords,
                   module.shift_coords, module.jitter_coords, module.rescale_coords, skip=skip,
                   layout="half" if module.rotate_half else "pairs", suffix=suffix)

    def extra_repr(self):
        periods = (f"min_period={self.min_period}, max_period={self.max_period}" if self.min_period is not None
                   else f"temperature={self.temperature}")
        return (f"dim={self.dim}, {periods}, normalize_coords={self.normalize_coords!r}, shift={self.shift}, "
                f"jitter={self.jitter}, rescale={self.rescale}, {self._options_repr('half')}")


class RoPEMRoPE(_RoPE):
    """Qwen-VL's multimodal RoPE (rpe::rope::mrope): three position ids per token (t, h, w); pair
    j < D/2 turns by ``pos_a · θ^(−2j/D)`` where the axis a of pair j comes from ``sections``
    (section_t, section_h, section_w) frequency pairs, consecutive chunks (Qwen2-VL, Qwen2.5-VL:
    (16, 24, 24) at D = 128) or, with ``interleaved`` (Qwen3-VL), h on j mod 3 = 1 below
    3·section_h, w on j mod 3 = 2 below 3·section_w, t otherwise. The sections must sum to D/2.
    Layout ``"half"`` (Qwen-VL's rotate_half) by default. No parameter. ``forward(x, height,
    width, positions)``: ``positions`` (N, 3) are the source's ``position_ids`` of the N = L −
    skip − suffix rotated tokens (as ``get_rope_index`` gives them: text tokens (n, n, n), vision
    tokens (t, h, w) offset by the text before them); on the grid (no positions) a token at
    (row, col) has the ids (0, row, col). Source: huggingface/transformers
    ``models/qwen2_vl/modeling_qwen2_vl.py`` (Qwen2VLRotaryEmbedding, apply_rotary_pos_emb),
    ``models/qwen3_vl`` (the interleaved layout). Raises ValueError for sections that are not 3
    non-negative integers (their sum against D is the operator's check)."""

    form = "mrope"
    position_axes = 3

    def __init__(self, sections=(16, 24, 24), theta=1000000.0, interleaved=False, skip=0, layout="half", suffix=0):
        super().__init__(skip, layout, suffix)
        sections = tuple(sections)
        if len(sections) != 3 or not all(_is_int(v) and v >= 0 for v in sections):
            raise ValueError(f"[rpe.torch] sections = {sections!r}; expected 3 ints >= 0 (t, h, w frequency pairs)")
        sections = tuple(operator.index(v) for v in sections)
        self.sections, self.theta, self.interleaved = sections, _theta(theta), _flag(interleaved, "interleaved")

    def _params(self):
        return [self.theta, *self.sections, 1.0 if self.interleaved else 0.0]

    def extra_repr(self):
        return (f"sections={self.sections}, theta={self.theta}, interleaved={self.interleaved}, "
                f"{self._options_repr('half')}")


def _clip_ids(frames, height, width, ids=None):
    """(N, 3) int64 (frame, row, col) of the tokens ``ids`` (N,) of a frames × height × width clip
    in row-major order (None: all of them), as V-JEPA 2's get_position_ids numbers them:
    frame = id div (height·width), row = (id mod height·width) div width, col = id mod width."""
    i = torch.arange(frames * height * width) if ids is None else ids.to(torch.int64)
    per_frame = height * width
    frame = torch.div(i, per_frame, rounding_mode="floor")
    rest = i - per_frame * frame
    row = torch.div(rest, width, rounding_mode="floor")
    return torch.stack([frame, row, rest - width * row], dim=1)


class RoPEVJEPA2(_RoPE):
    """V-JEPA 2's 3D RoPE (rpe::rope::vjepa2 through ``rope::custom``, channel layout
    rpe::rope::layout::vjepa2, its only one). A head of D channels is cut into three slices of
    ``s = 2·((D // 3) // 2)`` channels (the source's ``d_dim``, ``h_dim``, ``w_dim``; D = 64: 20,
    80: 26, 96: 32), rotated by the token's frame, row and col ids, then ``D − 3s`` channels passed
    through unrotated. Slice a has m = s/2 frequencies ``ω_k = 1/theta^(k/m)`` (float32), and
    channel l of the slice turns by ``pos_a·ω_(l mod m)`` with partner l xor 1 (the source's
    ``x·cos + rot(x)·sin``, rot pairing adjacent channels while cos, sin tile the m angles twice
    over the slice: not a rotation, reproduced as it is; the backward is the map's transpose).
    D must be even and >= 6.

    Positions: ``forward(x, height=None, width=None, positions=None, frames=None)`` rotates x
    (B, H, L, D) whose L = skip + N + suffix tokens are ``skip`` unrotated leading tokens, N
    rotated ones and ``suffix`` unrotated trailing ones. The N tokens are either
    ``positions`` (N, 3) (frame, row, col) ids, integer or real, on the CPU or x's device — the source's
    ``get_position_ids`` of the tokens (a mask's kept tokens: :meth:`get_position_ids`) — or a
    clip of ``frames`` × ``height`` × ``width`` tokens in row-major order (frame, then row, then
    col): ``frames`` defaults to ``grid_depth``, (height, width) to ``grid_size``, else a square
    of (L − skip − suffix)/frames. One frame is the operators' own grid (ids (0, row, col)); more
    frames go to the operators as their per-token ids. As ``rope=`` of
    :func:`rpe_torch.attention` the clip is (``grid_depth``, the attention's height, width or
    ``grid_size``), or ``positions`` / ``key_positions`` (N, 3).

    Attributes as the source's VJEPA2RopeAttention names them: ``grid_depth`` (frames of the clip,
    frames_per_clip // tubelet_size; default 1), ``grid_size`` (rows = cols of a frame,
    crop_size // patch_size, or a pair (rows, cols); None: inferred), and with ``head_dim`` given
    ``attention_head_size`` = head_dim and ``d_dim``, ``h_dim``, ``w_dim`` (the slices; x's D is
    then checked against it). ``theta``: the frequency base (the source's fixed 10000). No
    parameter or buffer (the source has none: nothing is learned). ``skip``, ``suffix`` as every
    RoPE module; ``layout`` is ``"vjepa2"`` (the only value taken).

    Source: huggingface/transformers ``models/vjepa2/modeling_vjepa2.py`` (rotate_queries_or_keys,
    VJEPA2RopeAttention.get_position_ids, apply_rotary_embeddings); facebookresearch/vjepa2
    ``src/models/utils/modules.py`` (RoPEAttention). Raises ValueError naming the argument for a
    head_dim the form cannot take (odd or < 6), a grid that does not give L tokens, positions not
    (N, 3); the operators' own messages for the rest (``[rpe.rope] vjepa2 head_dim D = 4 gives
    slices of 0 channels ...``)."""

    form = "vjepa2"
    layout = "vjepa2"
    layouts = ("vjepa2",)
    position_axes = 3
    position_names = "(frame, row, col)"

    def __init__(self, theta=10000.0, grid_depth=1, grid_size=None, head_dim=None, skip=0, suffix=0, layout="vjepa2"):
        super().__init__(skip, layout, suffix)
        self.theta = _real(theta, "theta")
        self.grid_depth = _count(grid_depth, "grid_depth")
        if grid_size is not None:
            rows, cols = _pair(grid_size, "grid_size")
            _count(rows, "grid_size rows")
            _count(cols, "grid_size cols")
        self.grid_size = None if grid_size is None else operator.index(grid_size) if _is_int(grid_size) else (rows, cols)
        self.attention_head_size = self.d_dim = self.h_dim = self.w_dim = None
        if head_dim is not None:
            d = _count(head_dim, "head_dim")
            if d % 2 or d < 6:
                raise ValueError(f"[rpe.torch] head_dim = {d}; expected an even number >= 6 (V-JEPA 2 rotates three "
                                 "slices of 2*((head_dim // 3) // 2) channels, at least one pair each)")
            self.attention_head_size = d
            self.d_dim = self.h_dim = self.w_dim = 2 * ((d // 3) // 2)

    @classmethod
    def from_transformers(cls, module, skip=0, suffix=0):
        """The RoPEVJEPA2 of a transformers ``VJEPA2RopeAttention`` (or any object with its
        attributes ``grid_depth``, ``grid_size``, ``attention_head_size``): the same clip and head
        dim, theta 10000 (the source's fixed base). Raises ValueError naming a missing attribute."""
        for name in ("grid_depth", "grid_size", "attention_head_size"):
            if not hasattr(module, name):
                raise ValueError(f"[rpe.torch] module ({type(module).__name__}) has no attribute {name!r}; expected "
                                 "a VJEPA2RopeAttention")
        return cls(10000.0, int(module.grid_depth), int(module.grid_size), int(module.attention_head_size), skip=skip,
                   suffix=suffix)

    def _rows_cols(self):
        return None if self.grid_size is None else _pair(self.grid_size, "grid_size")

    def get_position_ids(self, masks=None):
        """The (N, 3) int64 (frame, row, col) ids of the module's clip (``grid_depth`` ×
        ``grid_size``) as the source's ``get_position_ids`` gives them (stacked here: its
        (frame_ids, height_ids, width_ids) are the three columns): every token (masks None,
        N = grid_depth·rows·cols) or the kept tokens ``masks`` (N,) (integer indices into the
        clip, the source's mask of one sample). For ``positions`` of forward and of
        rpe_torch.attention. Raises ValueError without ``grid_size`` or for indices outside the clip."""
        grid = self._rows_cols()
        if grid is None:
            raise ValueError("[rpe.torch] grid_size = None; expected the frame's rows (and cols) to number the clip")
        n = self.grid_depth * grid[0] * grid[1]
        if masks is not None:
            if not isinstance(masks, torch.Tensor) or masks.dim() != 1 or masks.is_floating_point() \
                    or masks.is_complex() or masks.dtype == torch.bool:
                what = (f"a {masks.dtype} tensor of shape {tuple(masks.shape)}" if isinstance(masks, torch.Tensor)
                        else f"a {type(masks).__name__}")
                raise ValueError(f"[rpe.torch] masks is {what}; expected an integer tensor (N,) of kept token indices")
            if masks.numel() and (int(masks.min()) < 0 or int(masks.max()) >= n):
                raise ValueError(f"[rpe.torch] masks holds indices in [{int(masks.min())}, {int(masks.max())}]; "
                                 f"expected 0 <= index < {n} (grid_depth*rows*cols)")
        return _clip_ids(self.grid_depth, grid[0], grid[1], masks)

    def _check_head_dim(self, x, name="x"):
        """ValueError when x's D is not the ``head_dim`` the module was built with (if any)."""
        if self.attention_head_size is not None and x.shape[-1] != self.attention_head_size:
            raise ValueError(f"[rpe.torch] {name} has shape {tuple(x.shape)}; expected D = head_dim = "
                             f"{self.attention_head_size} (the RoPEVJEPA2 module's)")

    def _grid(self, L, height, width, positions=None, suffix=None, frames=None):
        """(height, width, positions) of the operators: positions as given; a one-frame clip as the
        operators' grid; a clip of several frames as its (frame, row, col) ids (grid 1 × 1).
        ``suffix``: the tokens' trailing unrotated count when not the module's."""
        if positions is not None:
            return height, width, positions
        frames = self.grid_depth if frames is None else _count(frames, "frames")
        if (height is None) != (width is None):
            raise ValueError(f"[rpe.torch] height = {height!r}, width = {width!r}; give both or neither")
        if height is None and self.grid_size is not None:
            height, width = self._rows_cols()
        suffix, name, note = self._suffix_names(suffix)
        L, rotated = int(L), int(L) - self.skip - suffix
        if height is None:
            side = math.isqrt(max(rotated, 0) // frames)
            if rotated < 1 or side * side * frames != rotated:
                raise ValueError(f"[rpe.torch] L = {L} is not skip + frames*side*side + {name} (skip = {self.skip}, "
                                 f"frames = {frames}, {name} = {suffix}{note}); "
                                 "pass height and width (or grid_size)")
            height = width = side
        if frames == 1:
            return height, width, None  # the operators' grid: ids (0, row, col)
        height, width = _count(height, "height"), _count(width, "width")
        if frames * height * width != rotated:
            raise ValueError(f"[rpe.torch] L = {L}; expected skip + frames*height*width + {name} = {self.skip} + "
                             f"{frames}*{height}*{width} + {suffix}{note and ' (' + note[2:] + ')'}")
        return 1, 1, _clip_ids(frames, height, width)

    def forward(self, x, height=None, width=None, positions=None, frames=None):
        """The map of x (B, H, L, D) (class docstring): at ``positions`` (N, 3) (frame, row, col),
        else on the clip of ``frames`` (default ``grid_depth``) × ``height`` × ``width`` (default
        ``grid_size``, else square). Raises ValueError / TypeError naming the argument (positions
        not (N, 3), a grid that does not give L, D against head_dim) or the library's message (D
        odd or < 6, theta)."""
        _check_positions("positions", positions, x, self.position_axes, self.position_names)
        _check_device("x", x)
        if x.dim() != 4:
            raise ValueError(f"[rpe.torch] x has shape {tuple(x.shape)}; expected (B, H, L, D)")
        self._check_head_dim(x)
        return self._rotate(x, *self._grid(x.shape[2], height, width, positions, frames=frames))

    def _params(self):
        return [self.theta]

    def extra_repr(self):
        head = "" if self.attention_head_size is None else f", head_dim={self.attention_head_size}"
        return (f"theta={self.theta}, grid_depth={self.grid_depth}, grid_size={self.grid_size}{head}, "
                f"{self._options_repr('vjepa2')}")


def rope(x, embedding, height=None, width=None, positions=None):
    """``embedding(x, height, width, positions)``: x (B, H, L, D) rotated by a RoPEAxial /
    RoPEMixed / RoPECat / RoPEDinoV3 / RoPEMRoPE / RoPEVJEPA2 module (on the grid, or at
    per-token ``positions`` (N, 2), (N, 3) for RoPEMRoPE and RoPEVJEPA2; integer ones must have
    |value| <= 2^24, exact in float32, else ValueError naming ``positions[n, a]``).
    Raises TypeError for another embedding."""
    if not isinstance(embedding, _RoPE):
        raise TypeError(f"[rpe.torch] embedding is a {type(embedding).__name__}; expected RoPEAxial, RoPEMixed, RoPECat, "
                        "RoPEDinoV3, RoPEMRoPE or RoPEVJEPA2")
    return embedding(x, height, width, positions)


# ---------------------------------------------------------------------------------------------
# Terms of the ViT mappings (swin, beit, decomposed, alibi)
# ---------------------------------------------------------------------------------------------

# The registry lookups below return strings, which a traced graph cannot hold: they are
# constant for a given argument (a plugin loaded later only adds families), so dynamo runs them
# while tracing (assume_constant_result) and torch.export's tracer (a dispatch mode) is set
# aside for them: a TermSlot built inside a compiled or exported forward (as the ViT modules do
# per call) adds no graph break and no node.
def _registry(op, *args):
    """torch.ops.rpe.<op>(*args) outside any tracing dispatch mode and outside torch.jit.trace's
    tracer (string-only operators: a traced graph cannot hold their str outputs; their results
    enter the trace as constants)."""
    tracing = torch._C._get_tracing_state()
    if tracing:
        torch._C._set_tracing_state(None)
    try:
        with _disable_current_modes():
            return getattr(torch.ops.rpe, op)(*args)
    finally:
        if tracing:
            torch._C._set_tracing_state(tracing)


@torch.compiler.assume_constant_result
def _known_families():
    """Every family name and alias of rpe's registry (a loaded plugin's included)."""
    return tuple(_registry("families", "", True))


@torch.compiler.assume_constant_result
def _natural_mode(method):
    """The family's one mode when it has one (decomposed: contextual), else bias (the registry's)."""
    return _registry("family_mode", method)


def _param_text(name, v):
    """The registry's text of a family parameter's value: true / false, an integer, a number or a
    choice name; ValueError naming the parameter otherwise."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, numbers.Integral):
        return str(int(v))
    if isinstance(v, numbers.Real):
        return repr(float(v))
    if isinstance(v, str) and v and not set(v) & set(",:= "):
        return v
    raise ValueError(f"[rpe.torch] params[{name!r}] = {v!r}; expected a number, a bool or a choice name")


@torch.compiler.assume_constant_result
def _slot_spec(method, params, window):
    """_cached_slot_spec, constant for dynamo (which traces through an lru_cache wrapper)."""
    return _cached_slot_spec(method, params, window)


@functools.lru_cache(maxsize=512)
def _cached_slot_spec(method, params, window):
    """The whole spec text of a TermSlot's term (every parameter, torch.ops.rpe.slot_spec): the
    registry parses ``method``, sets ``params`` ((name, text) pairs) and puts ``window`` into the
    family's window parameters where it has them. Returns (text, (window_h, window_w)): the
    family's window after that, (0, 0) without one. Cached: the ViT modules build a TermSlot per call."""
    text, h, w = _registry("slot_spec", method, [n for n, _ in params], [t for _, t in params], window[0], window[1])
    return text, (int(h), int(w))


class TermSlot:
    """A term given by its tables, for ``rpe_torch.attention`` (rpe_q / rpe_k / rpe_v) and
    :meth:`forward`. ``method``: a mapping family of rpe's registry (:func:`rpe_torch.families`:
    a built-in one or a loaded plugin's, by name or alias) or its spec text
    ``"family:param=value,..."``; ``params``: the family's parameters by name (a dict; set after
    the text's), e.g. ``TermSlot("manhattan", [t], grid=(7, 7), params={"beta": 5})`` =
    ``TermSlot("manhattan:beta=5", [t], grid=(7, 7))``; parameters not given keep the family's
    defaults (the registry's; ``slot.spec`` is the whole text). ``window`` (rows, cols): for the
    families with a window or grid parameter (``window_h``, ``window_w``: "swin" / "beit" window,
    "alibi" / "decomposed" grid) their value when the spec leaves it 0, and for every family the
    default grid; ``grid`` the default (height, width) (else the window; also the window
    parameters' value when no window is given). ``tables``: the tables as the operators read them
    ((Ht, K) bias, (Ht, D, K) contextual q / k, (Ht, K, D) v, two (1, D, K) for decomposed);
    ``mode``: "bias" / "contextual" (default: the family's one mode, else bias). E.g. SwinV2:
    ``TermSlot("swin", [cpb_table(raw, ws)], ws)``. Raises ValueError naming the family, parameter
    and value (unknown family or parameter, a value of the wrong kind) here; the mapping's own
    checks (e.g. the piecewise index's α < β < γ) and the tables' shapes are the operators'."""

    def __init__(self, method, tables, window=None, skip=0, mode=None, grid=None, params=None):
        if not isinstance(method, str):
            raise TypeError(f"[rpe.torch] method = {method!r}; expected a str (a family name or spec text)")
        known = _known_families()
        if method.split(":", 1)[0] not in known:
            raise ValueError(f"[rpe.torch] method = {method!r}; expected a family of rpe's registry (or its spec text "
                             f"'family:param=value,...'): {', '.join(known)}")
        tables = list(tables)
        if not tables or not all(isinstance(t, torch.Tensor) for t in tables):
            raise TypeError(f"[rpe.torch] tables = {tables!r}; expected a non-empty list of tensors")
        if params is None:
            params = {}
        if not isinstance(params, dict) or not all(isinstance(n, str) for n in params):
            raise TypeError(f"[rpe.torch] params = {params!r}; expected a dict of the family's parameters by name")
        self.method, self.tables, self.params = method, tables, dict(params)
        self.window = None if window is None else _pair(window, "window")
        self.grid = None if grid is None else _pair(grid, "grid")
        self.spec, spec_window = _slot_spec(method, tuple((n, _param_text(n, v)) for n, v in params.items()),
                                            self.window or self.grid or (0, 0))
        if self.window is None and spec_window[0] > 0 and spec_window[1] > 0:
            self.window = spec_window  # e.g. "swin:window_h=7,window_w=7": the default grid
        self.skip = skip
        self.mode = mode or _natural_mode(method)

    def _slot(self, L, height, width):
        """(method, mode, tables, alpha, beta, gamma, skip, height, width) for L tokens: the
        method is the whole spec text (the operators then ignore alpha, beta, gamma)."""
        L = int(L)
        if height is None and width is None:
            if self.grid is None and self.window is None:
                raise ValueError(f"[rpe.torch] height = None, width = None for the {self.method!r} TermSlot, which "
                                 "has no grid or window; pass height and width (or grid=(rows, cols))")
            height, width = self.grid or self.window
        elif (height is None) != (width is None):
            raise ValueError(f"[rpe.torch] height = {height!r}, width = {width!r}; give both or neither")
        if L != self.skip + height * width:
            raise ValueError(f"[rpe.torch] L = {L}; expected skip + height*width = {self.skip} + {height}*{width}")
        return self.spec, self.mode, self.tables, 0.0, 0.0, 0.0, self.skip, height, width

    def forward(self, x=None, height=None, width=None):
        """The term's output: bias (1, Ht, L, L), or contextual (B, H, L, L) from x (B, H, L, D)."""
        if (height is None) != (width is None):
            raise ValueError(f"[rpe.torch] height = {height!r}, width = {width!r}; give both or neither")
        if self.mode != "bias" and x is None:
            raise ValueError(f"[rpe.torch] x is None; expected (B, H, L, D) queries for the {self.method} term")
        L = x.shape[2] if x is not None else None
        if L is None:
            h, w = (height, width) if height is not None else (self.grid or self.window or (0, 0))
            L = self.skip + h * w
        method, mode, tables, a, b, g, skip, h, w = self._slot(L, height, width)
        return term(x, tables, method, mode, "k", a, b, g, skip, h, w)

    def __call__(self, x=None, height=None, width=None):
        return self.forward(x, height, width)

    def __repr__(self):
        return f"TermSlot({self.spec!r}, mode={self.mode!r}, skip={self.skip}, grid={self.grid or self.window})"


def table_from_timm(timm_table):
    """rpe's (H, K) table from timm's ``relative_position_bias_table`` (K, H) (Swin, BEiT), as
    rpe::table_from_timm; differentiable."""
    _check_device("timm_table", timm_table)
    return _ops.table_from_timm(timm_table)


def table_to_timm(table):
    """timm's (K, H) layout from rpe's (H, K) table, as rpe::table_to_timm; differentiable."""
    _check_device("table", table)
    return _ops.table_to_timm(table)


class RelPosBias(nn.Module):
    """Swin / BEiT relative position bias (rpe::mapping::swin, rpe::mapping::beit): ``kind``
    "swin" (window attention, skip 0) or "beit" (the class token first: skip 1, three extra
    buckets). The learned table is ``relative_position_bias_table`` (K, num_heads) in timm's
    layout (``timm_layout=True``, so timm state dicts load) or ``table`` (num_heads, K);
    K = (2Wh−1)(2Ww−1) (+3 for beit with skip, +1 for swin with skip). Zero-initialised (timm:
    trunc_normal(std=0.02); apply your own). ``forward(height=None, width=None)`` gives the
    (1, num_heads, L, L) bias on the window grid (or a smaller height × width one),
    L = skip + height·width. Usable as ``rpe_k`` of ``rpe_torch.attention``."""

    def __init__(self, window_size, num_heads, kind="swin", skip=None, timm_layout=True):
        super().__init__()
        if kind not in ("swin", "beit"):
            raise ValueError(f"[rpe.torch] kind = {kind!r}; expected 'swin' or 'beit'")
        self.kind, self.window_size = kind, _pair(window_size, "window_size")
        self.skip = (1 if kind == "beit" else 0) if skip is None else skip
        if not isinstance(self.skip, int) or self.skip < 0:
            raise ValueError(f"[rpe.torch] skip = {self.skip!r}; expected an int >= 0")
        self.num_heads, self.timm_layout = _count(num_heads, "num_heads"), timm_layout
        k = int(_ops.num_buckets(kind, float(self.window_size[0]), float(self.window_size[1]), 0.0, self.skip))
        if timm_layout:
            self.relative_position_bias_table = nn.Parameter(torch.zeros(k, num_heads))
        else:
            self.table = nn.Parameter(torch.zeros(num_heads, k))

    def _tables(self):
        return [table_from_timm(self.relative_position_bias_table) if self.timm_layout else self.table]

    def _slot(self, L, height, width):
        return TermSlot(self.kind, self._tables(), self.window_size, self.skip)._slot(L, height, width)

    def forward(self, height=None, width=None):
        """(1, num_heads, L, L) bias. Raises ValueError for a grid larger than the window."""
        return TermSlot(self.kind, self._tables(), self.window_size, self.skip).forward(None, height, width)

    def extra_repr(self):
        return f"kind={self.kind!r}, window_size={self.window_size}, num_heads={self.num_heads}, skip={self.skip}"


# ---------------------------------------------------------------------------------------------
# SwinV2 continuous position bias
# ---------------------------------------------------------------------------------------------

def relative_log_coords(window_size, pretrained_window_size=(0, 0), mode="swin"):
    """SwinV2's log-spaced relative coordinates (rpe::relative_log_coords): a (K, 2) float32
    tensor, K = (2Wh−1)(2Ww−1) in Swin's bucket order, (dr, dc) per row — the CPB MLP's input
    (timm's ``relative_coords_table`` flattened). ``pretrained_window_size`` (0, 0): normalise by
    this window; ``mode`` "swin" or "cr" (like timm's, "cr" ignores ``pretrained_window_size``).
    Raises ValueError with the library's message."""
    wh, ww = _pair(window_size, "window_size")
    ph, pw = _pair(pretrained_window_size, "pretrained_window_size")
    return _ops.relative_log_coords(wh, ww, ph, pw, mode)


def cpb_table(raw, window_size, sigmoid16=True):
    """SwinV2's (H, K) bias table from the CPB MLP's output ``raw`` (K, H) (timm's
    ``cpb_mlp(relative_coords_table).view(-1, H)``): ``16·sigmoid(raw)ᵀ`` (or ``rawᵀ``),
    rpe::cpb_bias::make_table; differentiable in raw. Feed it to the attention as
    ``TermSlot("swin", [cpb_table(raw, ws)], ws)``."""
    _check_device("raw", raw)
    wh, ww = _pair(window_size, "window_size")
    return _ops.cpb_table(raw.contiguous(), wh, ww, bool(sigmoid16))


def cpb_bias(raw, window_size, sigmoid16=True):
    """SwinV2's (1, H, L, L) bias on the window grid (L = Wh·Ww) from the CPB MLP's output raw
    (K, H) (rpe::cpb_bias::forward); differentiable in raw (then through the user's MLP)."""
    _check_device("raw", raw)
    wh, ww = _pair(window_size, "window_size")
    return _ops.cpb_bias_forward(raw.contiguous(), wh, ww, bool(sigmoid16))


# ---------------------------------------------------------------------------------------------
# SAM decomposed relative position
# ---------------------------------------------------------------------------------------------

def resize_rel_pos(rel_pos, length):
    """SAM ``get_rel_pos``'s resize of a (Lin, C) table to (length, C) (linear interpolation,
    align_corners=False; rpe::vit::resize_rel_pos); differentiable."""
    _check_device("rel_pos", rel_pos)
    if rel_pos.dim() != 2:
        raise ValueError(f"[rpe.torch] rel_pos has shape {tuple(rel_pos.shape)}; expected (length, C)")
    return _ops.resize_rel_pos(rel_pos, _count(length, "length", 1, 1 << 20))


def _decomposed_tables(rel_pos_h, rel_pos_w, height, width, skip, unscaled_query):
    _check_device("rel_pos_h", rel_pos_h)
    _check_device("rel_pos_w", rel_pos_w)
    return list(_ops.decomposed_tables(rel_pos_h, rel_pos_w, int(height), int(width), int(skip), bool(unscaled_query)))


def decomposed_rel_pos(q, rel_pos_h, rel_pos_w, height, width, skip=0):
    """SAM's decomposed relative position terms (``add_decomposed_rel_pos`` without the attention):
    ``out[b, h, i, j] = q[b,h,i]·R_h[Δrow + H−1] + q[b,h,i]·R_w[Δcol + W−1]``, (B, nH, L, L), for q
    (B, nH, L, C) as SAM passes it (unscaled), rel_pos_h (Lh, C), rel_pos_w (Lw, C) (resized as
    ``get_rel_pos`` when Lh ≠ 2H−1 / Lw ≠ 2W−1); L = skip + H·W (skip tokens get 0). rpe's
    "decomposed" term (rpe::vit); differentiable in q and both tables."""
    _check_device("q", q)
    for name, t in (("rel_pos_h", rel_pos_h), ("rel_pos_w", rel_pos_w)):
        if q.dim() == 4 and t.dim() == 2 and t.shape[1] != q.shape[3]:
            raise ValueError(f"[rpe.torch] {name} has shape {tuple(t.shape)}; expected C = {q.shape[3]} columns, "
                             "the head_dim of q")
    tables = _decomposed_tables(rel_pos_h, rel_pos_w, height, width, skip, False)
    return term(q, tables, "decomposed", "contextual", "k", float(height), float(width), 0.0, skip, height, width)


class DecomposedRelPos(nn.Module):
    """SAM's ``Attention(use_rel_pos=True)`` position tables ``rel_pos_h`` (Lh, head_dim),
    ``rel_pos_w`` (Lw, head_dim) on a height × width grid (Lh, Lw default 2H−1, 2W−1; others are
    resized as ``get_rel_pos``), zero-initialised as SAM. ``forward(q)`` gives the (B, nH, L, L)
    terms of decomposed_rel_pos; as ``rpe_k`` of ``rpe_torch.attention`` (default scale) the
    logits get SAM's ``q·R`` (unscaled q), both tables differentiated."""

    def __init__(self, height, width, head_dim, rel_pos_lengths=None, skip=0):
        super().__init__()
        self.height, self.width = _count(height, "height"), _count(width, "width")
        self.skip = _count(skip, "skip", 0)
        _count(head_dim, "head_dim")
        lh, lw = rel_pos_lengths if rel_pos_lengths is not None else (2 * height - 1, 2 * width - 1)
        _count(lh, "rel_pos_lengths[0]", 1, 1 << 20)
        _count(lw, "rel_pos_lengths[1]", 1, 1 << 20)
        self.rel_pos_h = nn.Parameter(torch.zeros(lh, head_dim))
        self.rel_pos_w = nn.Parameter(torch.zeros(lw, head_dim))

    def _slot(self, L, height, width):
        if (height, width) not in ((None, None), (self.height, self.width)):
            raise ValueError(f"[rpe.torch] height = {height!r}, width = {width!r}; this DecomposedRelPos is built for "
                             f"{self.height}x{self.width} (build one for the grid it runs on)")
        tables = _decomposed_tables(self.rel_pos_h, self.rel_pos_w, self.height, self.width, self.skip, True)
        return TermSlot("decomposed", tables, (self.height, self.width), self.skip)._slot(L, None, None)

    def forward(self, q):
        """(B, nH, L, L) terms for q (B, nH, L, head_dim), unscaled as SAM passes it."""
        return decomposed_rel_pos(q, self.rel_pos_h, self.rel_pos_w, self.height, self.width, self.skip)


# ---------------------------------------------------------------------------------------------
# 2D ALiBi
# ---------------------------------------------------------------------------------------------

def alibi_slopes(num_heads):
    """ALiBi's per-head slopes as CROMA's ``get_slopes`` (rpe::vit::alibi_slopes), a list of floats."""
    return list(_ops.alibi_slopes(int(num_heads)))


class ALiBi2D(nn.Module):
    """CROMA's 2D ALiBi (rpe::vit, "alibi" term): ``bias[h, i, j] = −m_h·√(Δr² + Δc²)`` on a
    height × width grid after ``skip`` tokens (bias 0 for them); the fixed (num_heads, K) table is
    the buffer ``table`` (rpe::vit::alibi_2d_table; no parameter). ``forward()`` gives the
    (1, num_heads, L, L) bias; usable as ``rpe_k`` of ``rpe_torch.attention``.

    ``dtype``: any floating-point dtype the module can be converted to with ``.to(dtype)``
    (float32, float64, bfloat16, float16): float32 and float64 tables are the library's; a bfloat16
    or float16 one is the float64 table rounded once to it (the operators take both on the CPU
    and on CUDA). TypeError for a dtype that is not floating point."""

    def __init__(self, num_heads, height, width, skip=0, dtype=torch.float32):
        super().__init__()
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"[rpe.torch] dtype = {dtype}; expected a floating-point torch.dtype (torch.float32, "
                            "torch.float64, torch.bfloat16 or torch.float16)")
        self.num_heads, self.height, self.width, self.skip = int(num_heads), int(height), int(width), int(skip)
        f64 = dtype != torch.float32  # float64, or rounded once from it to bfloat16 / float16
        table = _ops.alibi_2d_table(self.num_heads, self.height, self.width, self.skip, f64)
        self.register_buffer("table", table.to(dtype))

    def _slot(self, L, height, width):
        if (height, width) not in ((None, None), (self.height, self.width)):
            raise ValueError(f"[rpe.torch] height = {height!r}, width = {width!r}; this ALiBi2D is built for "
                             f"{self.height}x{self.width} (build one for the grid it runs on)")
        return TermSlot("alibi", [self.table], (self.height, self.width), self.skip)._slot(L, None, None)

    def forward(self):
        """(1, num_heads, L, L) bias, L = skip + height·width."""
        return TermSlot("alibi", [self.table], (self.height, self.width), self.skip).forward()
