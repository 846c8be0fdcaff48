"""rpe_torch in timm's own models: :func:`swap_attention` makes the attention modules of a timm
model run ``rpe_torch.attention`` (rpe's fused kernels) instead of timm's attention core.

One line per model, whatever the family::

    import timm, rpe_torch.timm
    model = timm.create_model("deit_small_patch16_224")
    rpe_torch.timm.swap_attention(model)                  # in place; returns the model

The swap changes each attention module's class to a subclass of timm's own class (defined here,
so ``torch.save(model)`` and ``copy.deepcopy`` work) whose ``forward`` computes q, k, v, the
position encoding and the output projection with timm's own parameters and sends the attention
step to rpe's kernels; no parameter, buffer or state-dict key changes (except the iRPE tables
that ``rpe_config`` adds), and :func:`restore_attention` puts timm's classes back.

What each family maps onto (timm 1.0):

============================  ==========================================  ==============================
timm attention                models                                      rpe term
============================  ==========================================  ==============================
``timm.layers.Attention``     ViT / DeiT (``vit_*``, ``deit_*``)          none, or iRPE (``rpe_config``)
``beit.Attention``            BEiT (``beit_*``)                           ``beit`` bias (timm's table)
``swin_transformer`` W-MSA    Swin (``swin_*``)                           ``swin`` bias + shift masks
``swin_transformer_v2`` W-MSA SwinV2 (``swinv2_*``, not ``_cr``)          ``swin`` bias from the CPB MLP
``eva.EvaAttention``          EVA-02 (``eva02_*``), DINOv3                RoPE ``cat``, ``dinov3``
                              (``vit_*_dinov3*``)
``AttentionRope`` (eva.py)    rope-vit (``vit_*_rope_*``)                 RoPE ``cat`` (axial) / ``mixed``
``vision_transformer_sam``    ViT-SAM (``samvit_*``)                      ``decomposed`` (rel_pos_h/w)
============================  ==========================================  ==============================

Refused with an error naming the reason (never run as something else): attention dropout > 0
while training (rpe has no dropout on the probabilities), a per-batch or per-head ``attn_mask``,
timm's RoPE coordinate augmentation while training (DINOv3's shift / jitter / rescale, EVA's),
patch dropout with RoPE, ``rotate_half`` over RoPE-Mixed or differing between the RoPE module and
the attention, the ``mrope`` RoPE type, grouped-query attention, BEiT's shared relative position
bias without its module. ``dynamic_img_size`` models: a forward hook on the patch embedding
records each forward's grid for the iRPE and RoPE terms. ``rope_rotate_half=True``
(timm's half layout: DINOv3's own, and the cat RoPE built with it) maps to rpe's layout "half".
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from timm.layers import Attention as _TimmAttention
from timm.layers import AttentionRope as _TimmAttentionRope
from timm.layers.pos_embed_sincos import RotaryEmbeddingCat as _TimmRopeCat
from timm.layers.pos_embed_sincos import RotaryEmbeddingDinoV3 as _TimmRopeDinoV3
from timm.layers.pos_embed_sincos import RotaryEmbeddingMixed as _TimmRopeMixed
from timm.models import beit as _beit
from timm.models import eva as _eva
from timm.models import swin_transformer as _swin
from timm.models import swin_transformer_v2 as _swin_v2
from timm.models import vision_transformer_sam as _sam

from . import attention as _attention
from . import build_rpe
from .vit import RoPECat, RoPEDinoV3, TermSlot, _decomposed_tables, _RoPE, cpb_table, table_from_timm

__all__ = ["swap_attention", "restore_attention", "swapped", "UNSUPPORTED"]

#: Attention classes of timm that have no rpe counterpart, with the reason (docs/torch.md).
UNSUPPORTED = {
    "swin_transformer_v2_cr.WindowMultiHeadAttention": "SwinV2-CR: its CPB MLP and cosine attention are mapped, "
                                                         "but not tested here; not swapped",
    "vision_transformer_relpos.RelPosAttention": "timm's relpos ViT: a bias MLP over log coordinates on a "
                                                 "class-token layout rpe has no mapping for",
    "layers.DiffAttention": "differential attention (two softmaxes subtracted): not one attention step",
}


def _fail(module, why):
    raise NotImplementedError(f"[rpe.torch] {type(module).__name__}: {why}")


def _check_dropout(m):
    if m.training and m.attn_drop.p > 0:
        _fail(m, f"attention dropout p = {m.attn_drop.p} while training; rpe_torch.attention has no dropout on the "
                 "probabilities (build the model with attn_drop_rate=0, or call model.eval())")


def _merge(x):
    """(B, H, N, D) -> (B, N, H·D)."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


def _qkv_eva(m, x):
    """q, k, v (B, H, N, D) of timm's BEiT / EVA / SwinV2 projection (q_bias, zero k_bias, v_bias)."""
    b, n, _ = x.shape
    if m.q_bias is None:
        qkv = m.qkv(x)
    else:
        bias = torch.cat((m.q_bias, m.k_bias, m.v_bias))
        if getattr(m, "qkv_bias_separate", False):
            qkv = m.qkv(x) + bias
        else:
            qkv = F.linear(x, weight=m.qkv.weight, bias=bias)
    return qkv.reshape(b, n, 3, m.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)


def _mask(attn_mask, is_causal, n, like):
    """timm's attn_mask / is_causal as one (N, N) additive mask (or None)."""
    if is_causal:
        return like.new_full((n, n), float("-inf")).triu_(1)
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:  # timm / SDPA: True = attend
        attn_mask = torch.zeros(attn_mask.shape, dtype=like.dtype).masked_fill_(~attn_mask, float("-inf"))
    while attn_mask.dim() > 2 and attn_mask.shape[0] == 1:
        attn_mask = attn_mask[0]
    if attn_mask.shape != (n, n):
        raise NotImplementedError(f"[rpe.torch] attn_mask has shape {tuple(attn_mask.shape)}; rpe_torch.attention "
                                  f"takes one ({n}, {n}) mask shared by the batch and the heads")
    return attn_mask.detach()


class _GridRecorder:
    """Forward hook of a ``dynamic_img_size`` model's patch embedding (timm's NHWC output
    (B, H, W, C) in that mode): records this forward's patch grid for the swapped attention
    modules, which see only (B, N, C) tokens. A module-level class, so the model still pickles."""

    def __init__(self, grid):
        self.grid = grid

    def __call__(self, module, inputs, output):
        if output.dim() == 4:
            self.grid = (int(output.shape[1]), int(output.shape[2]))


def _grid(m, n, skip):
    """(height, width) of the patch grid: this forward's (``dynamic_img_size``) or the one
    recorded at swap time; checked against N tokens."""
    recorder = m.__dict__.get("_rpe_grid_recorder")
    h, w = recorder.grid if recorder is not None else m.__dict__["_rpe_grid"]
    if n != skip + h * w:
        raise NotImplementedError(f"[rpe.torch] {type(m).__name__}: {n} tokens, but the model's grid is {h}x{w} "
                                  f"after {skip} prefix tokens (a changed image size needs swap_attention again)")
    return h, w


# ---------------------------------------------------------------------------------------------
# ViT / DeiT (timm.layers.Attention), optionally with iRPE
# ---------------------------------------------------------------------------------------------

class RpeAttention(_TimmAttention):
    """timm.layers.Attention on rpe_torch.attention; ``rpe_q`` / ``rpe_k`` / ``rpe_v``: iRPE
    modules (from ``swap_attention(rpe_config=...)``) or None."""

    def forward(self, x, attn_mask=None, is_causal=False):
        _check_dropout(self)
        b, n, _ = x.shape
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        rpes = [getattr(self, name, None) for name in ("rpe_q", "rpe_k", "rpe_v")]
        h, w = (None, None)
        if any(r is not None for r in rpes):
            h, w = _grid(self, n, self.__dict__["_rpe_skip"])
        x = _attention(q, k, v, *rpes, height=h, width=w, attn_mask=_mask(attn_mask, is_causal, n, q),
                       scale=self.scale)
        x = self.norm(_merge(x))
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


# ---------------------------------------------------------------------------------------------
# BEiT
# ---------------------------------------------------------------------------------------------

class RpeBeitAttention(_beit.Attention):
    """BEiT's attention on rpe_torch.attention with the ``beit`` term over timm's own
    ``relative_position_bias_table`` (and the shared table's module, when the model has one)."""

    def forward(self, x, shared_rel_pos_bias=None):
        _check_dropout(self)
        b, n, _ = x.shape
        q, k, v = _qkv_eva(self, x)
        tables = []
        if self.relative_position_bias_table is not None:
            tables.append(self.relative_position_bias_table)
        if shared_rel_pos_bias is not None:
            shared = self.__dict__.get("_rpe_shared")
            if shared is None:
                _fail(self, "shared_rel_pos_bias given, but no shared RelativePositionBias module was found at swap time")
            tables.append(shared.relative_position_bias_table)
        slot = None
        if tables:
            table = tables[0] if len(tables) == 1 else tables[0] + tables[1]
            window = self.window_size if self.window_size is not None else shared.window_size
            slot = TermSlot("beit", [table_from_timm(table)], tuple(window), skip=1)
        x = _attention(q, k, v, rpe_k=slot, scale=self.scale)
        return self.proj_drop(self.proj(_merge(x)))


# ---------------------------------------------------------------------------------------------
# Swin, SwinV2 (window attention, shifted-window masks)
# ---------------------------------------------------------------------------------------------

def _windows(q, k, v, mask, run):
    """run(q, k, v, attn_mask) over (num_windows·B, H, N, D) windows, the windows of each distinct
    (N, N) mask of ``mask`` (num_windows, N, N) in one call (a shifted Swin stage has at most 4).
    While torch.compile or torch.export traces, the distinct masks are data the graph cannot
    count: there, one call per window position (every image's window at it; num_windows calls)."""
    if mask is None:
        return run(q, k, v, None)
    nw, n = mask.shape[0], mask.shape[1]
    shape = (q.shape[0] // nw, nw) + tuple(q.shape[1:])
    q, k, v = (t.reshape((shape[0], nw) + tuple(t.shape[1:])) for t in (q, k, v))
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        outs = [run(q[:, w], k[:, w], v[:, w], mask[w].to(q.dtype)) for w in range(nw)]
        return torch.stack(outs, 1).flatten(0, 1)
    masks, which = torch.unique(mask.reshape(nw, n * n), dim=0, return_inverse=True)
    outs, order = [], []
    for u in range(masks.shape[0]):
        idx = (which == u).nonzero().flatten()
        sel = [t.index_select(1, idx).flatten(0, 1) for t in (q, k, v)]
        out = run(*sel, masks[u].reshape(n, n).to(q.dtype))
        outs.append(out.reshape((shape[0], idx.numel()) + tuple(out.shape[1:])))
        order.append(idx)
    out = torch.cat(outs, 1).index_select(1, torch.argsort(torch.cat(order)))
    return out.flatten(0, 1)


class RpeSwinAttention(_swin.WindowAttention):
    """Swin's window attention on rpe_torch.attention: the ``swin`` term over timm's own
    ``relative_position_bias_table``; the shifted windows' masks as rpe's additive mask."""

    def forward(self, x, mask=None):
        _check_dropout(self)
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        ws = tuple(self.window_size)
        slot = TermSlot("swin", [table_from_timm(self.relative_position_bias_table)], ws)
        x = _windows(q, k, v, mask, lambda q, k, v, m: _attention(q, k, v, rpe_k=slot, attn_mask=m, scale=self.scale))
        return self.proj_drop(self.proj(_merge(x)))


class RpeSwinV2Attention(_swin_v2.WindowAttention):
    """SwinV2's window attention on rpe_torch.attention: cosine attention (normalised q times the
    clamped per-head logit scale, scale 1) and the ``swin`` term over the (H, K) table that
    rpe's cpb_table makes from timm's own CPB MLP output (16·sigmoid)."""

    def forward(self, x, mask=None):
        _check_dropout(self)
        q, k, v = _qkv_eva(self, x)
        logit_scale = torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        q = F.normalize(q, dim=-1) * logit_scale
        k = F.normalize(k, dim=-1)
        ws = tuple(self.window_size)
        raw = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
        slot = TermSlot("swin", [cpb_table(raw, ws)], ws)
        x = _windows(q, k, v, mask, lambda q, k, v, m: _attention(q, k, v, rpe_k=slot, attn_mask=m, scale=1.0))
        return self.proj_drop(self.proj(_merge(x)))


# ---------------------------------------------------------------------------------------------
# EVA-02 and rope-vit (eva.py: EvaAttention, AttentionRope with the model's RoPE module)
# ---------------------------------------------------------------------------------------------

def _rope_of(model_rope, layer, skip=0, half=False):
    """rpe's RoPE for a timm RoPE module: ("cat", RoPECat), ("mixed", the block's RoPE-Mixed) or
    ("dinov3", RoPEDinoV3); ``half``: the attention's ``rotate_half`` (timm's apply_rot_embed_cat
    half=True: rpe's layout "half"), which must be the RoPE module's own; NotImplementedError
    naming what does not map."""
    def layout_of(r):
        if bool(getattr(r, "rotate_half", False)) != half:
            _fail(r, f"rotate_half = {bool(getattr(r, 'rotate_half', False))} in the RoPE module but {half} in the "
                     "attention; rpe rotates q and k as the embedding is laid out")
        return "half" if half else "pairs"

    if isinstance(model_rope, _TimmRopeDinoV3):
        layout_of(model_rope)
        return "dinov3", RoPEDinoV3.from_timm(model_rope, skip)
    if isinstance(model_rope, _TimmRopeCat):
        r = model_rope
        layout = layout_of(r)
        if getattr(r, "grid_type", "pixel" if r.in_pixels else "index") != ("pixel" if r.in_pixels else "index"):
            _fail(r, f"grid_type = {r.grid_type!r}; rpe's cat form has timm's default grid for in_pixels = {r.in_pixels}")
        if r.in_pixels and getattr(r, "normalize_coords", "separate") != "separate":
            _fail(r, f"normalize_coords = {r.normalize_coords!r}; expected 'separate'")
        return "cat", RoPECat(temperature=float(r.temperature), in_pixels=bool(r.in_pixels), max_res=float(r.max_res),
                              linear_bands=bool(r.linear_bands), grid_offset=float(r.grid_offset),
                              ref_feat_shape=None if r.ref_feat_shape is None else tuple(r.ref_feat_shape),
                              grid_indexing=r.grid_indexing, skip=skip, layout=layout)
    if isinstance(model_rope, _TimmRopeMixed):
        if half:
            _fail(model_rope, "rotate_half attention over timm's RotaryEmbeddingMixed (its embedding is interleaved)")
        if model_rope.grid_indexing != "xy":
            _fail(model_rope, f"grid_indexing = {model_rope.grid_indexing!r}; rpe's mixed form is rope-vit's 'xy'")
        return "mixed", _TimmMixedRoPE(model_rope, layer, skip)
    _fail(model_rope, "this RoPE type has no rpe form in rpe_torch.timm (it has rope-vit's axial / mixed, timm's cat "
                      "and DINOv3)")


class _TimmMixedRoPE(_RoPE):
    """rpe_torch's RoPE-Mixed reading block ``layer``'s frequencies (2, H, D/2) from timm's
    RotaryEmbeddingMixed ``freqs`` (2, depth, H, D/2), so that their gradient reaches timm's
    parameter (the timm module is held outside the module tree: no new state-dict key)."""

    form = "mixed"

    def __init__(self, rope, layer, skip):
        super().__init__(skip)
        self.__dict__["_timm_rope"] = rope
        self.layer = layer

    def _freqs(self):
        return self.__dict__["_timm_rope"].freqs[:, self.layer]


def _eva_attention(m, q, k, v, rope, attn_mask, is_causal):
    """rpe_torch.attention for an EVA / rope-vit block; ``rope``: the embedding timm passes (only
    its presence and shape are used: rpe rotates with the RoPE recorded at swap time)."""
    n = q.shape[2]
    r, h, w = None, None, None
    if rope is not None:
        spec = m.__dict__.get("_rpe_rope")
        if spec is None:
            _fail(m, "a RoPE embedding was passed, but the model's RoPE module was not found at swap time")
        if rope.dim() > (3 if spec[0] == "mixed" else 2):
            _fail(m, "a per-sample RoPE embedding (patch dropout); rpe rotates by grid position")
        if m.training and getattr(m.__dict__.get("_rpe_rope_module"), "aug_active", False):
            _fail(m, "timm's RoPE coordinate augmentation while training; rpe rotates by the plain grid")
        r = spec[1]
        h, w = _grid(m, n, m.num_prefix_tokens)
    return _attention(q, k, v, rope=r, height=h, width=w, attn_mask=_mask(attn_mask, is_causal, n, q), scale=m.scale)


def _eva_output(self, x, q, k, v, rope, attn_mask, is_causal):
    """The part of EvaAttention.forward and AttentionRope.forward after q, k, v (B, H, N, D): q/k
    norms, rpe_torch's attention, the output norm, the optional sigmoid gate of x, the projection."""
    gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
    q, k = self.q_norm(q), self.k_norm(k)
    out = self.norm(_merge(_eva_attention(self, q, k, v, rope, attn_mask, is_causal)))
    if gate is not None:
        out = out * gate
    return self.proj_drop(self.proj(out))


class RpeEvaAttention(_eva.EvaAttention):
    """EVA's attention (EVA-02) on rpe_torch.attention, RoPE by rpe's kernels from the model's
    RotaryEmbeddingCat settings (the ``rope`` tensor timm passes is not used)."""

    def forward(self, x, rope=None, attn_mask=None, is_causal=False):
        _check_dropout(self)
        b, n, c = x.shape
        if self.qkv is not None:
            q, k, v = _qkv_eva(self, x)
        else:
            q, k, v = (p(x).reshape(b, n, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj,
                                                                                            self.v_proj))
        return _eva_output(self, x, q, k, v, rope, attn_mask, is_causal)


class RpeAttentionRope(_TimmAttentionRope):
    """timm's AttentionRope (the rope-vit models in eva.py) on rpe_torch.attention, RoPE by rpe's
    kernels: the cat form (rope-vit Axial as timm builds it) or rope-vit's Mixed over the model's
    learned frequencies of this block."""

    def forward(self, x, rope=None, attn_mask=None, is_causal=False):
        _check_dropout(self)
        if getattr(self, "num_kv_groups", 1) > 1:
            _fail(self, "grouped-query attention (num_kv_heads < num_heads)")
        b, n, c = x.shape
        if self.qkv is not None:
            q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = (p(x).reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2) for p in (self.q_proj,
                                                                                                   self.k_proj,
                                                                                                   self.v_proj))
        return _eva_output(self, x, q, k, v, rope, attn_mask, is_causal)


# ---------------------------------------------------------------------------------------------
# ViT-SAM (decomposed relative position)
# ---------------------------------------------------------------------------------------------

class RpeSamAttention(_sam.Attention):
    """SAM's attention (timm's samvit, global and windowed blocks) on rpe_torch.attention with the
    ``decomposed`` term over timm's own ``rel_pos_h`` / ``rel_pos_w`` (resized as get_rel_pos),
    or the cat RoPE of its ``rope`` module."""

    def forward(self, x):
        _check_dropout(self)
        b, h, w, _ = x.shape
        n = h * w
        q, k, v = self.qkv(x.reshape(b, n, -1)).view(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        slot, rope = None, None
        if self.use_rel_pos:
            tables = _decomposed_tables(self.rel_pos_h, self.rel_pos_w, h, w, 0, True)
            slot = TermSlot("decomposed", tables, (h, w))
        elif self.rope is not None:
            kind, rope = _rope_of(self.rope, 0)
            if kind != "cat":
                _fail(self, "a RoPE other than timm's RotaryEmbeddingCat")
        x = _attention(q, k, v, rpe_k=slot, rope=rope, height=h, width=w, scale=self.scale)
        x = self.proj_drop(self.proj(_merge(x)))
        return x.view(b, h, w, -1)


# timm class -> its rpe subclass
_SWAPS = {
    _TimmAttention: RpeAttention,
    _beit.Attention: RpeBeitAttention,
    _swin.WindowAttention: RpeSwinAttention,
    _swin_v2.WindowAttention: RpeSwinV2Attention,
    _eva.EvaAttention: RpeEvaAttention,
    _TimmAttentionRope: RpeAttentionRope,
    _sam.Attention: RpeSamAttention,
}
_BACK = {v: k for k, v in _SWAPS.items()}


def _prefix_tokens(model):
    return int(getattr(model, "num_prefix_tokens", 1 if getattr(model, "cls_token", None) is not None else 0))


def swap_attention(model, rpe_config=None):
    """Makes every attention module of the timm ``model`` that rpe supports run rpe_torch's fused
    attention (in place; returns the model). Parameters, buffers and state-dict keys stay timm's.

    ``rpe_config``: for ViT / DeiT only, an iRPE configuration (``rpe_torch.get_rpe_config``, its
    ``skip`` = the model's prefix tokens) whose modules (zero tables, as the reference) are added
    to each block's attention as ``rpe_q`` / ``rpe_k`` / ``rpe_v`` (the reference DeiT-iRPE's names).

    Raises NotImplementedError when the model has no attention rpe can run (naming its class and
    the reason: :data:`UNSUPPORTED`), or a setting of a supported family does not map (module
    docstring); ValueError for an ``rpe_config`` whose skip is not the prefix-token count.
    """
    grid = None
    pe = getattr(model, "patch_embed", None)
    if pe is not None and getattr(pe, "grid_size", None) is not None:
        grid = tuple(int(s) for s in pe.grid_size)
    recorder = None
    if getattr(model, "dynamic_img_size", False):  # the grid of each forward, from the patch embedding
        if pe is None or grid is None:
            raise NotImplementedError("[rpe.torch] the model was built with dynamic_img_size=True but has no "
                                      "patch_embed with a grid_size to follow")
        recorder = next((h for h in pe._forward_hooks.values() if isinstance(h, _GridRecorder)), None)
        if recorder is None:
            recorder = _GridRecorder(grid)
            pe.register_forward_hook(recorder)
    skip = _prefix_tokens(model)
    if rpe_config is not None and rpe_config.get("rpe_k", rpe_config.get("rpe_q", rpe_config.get("rpe_v"))) is not None:
        for c in (rpe_config.rpe_q, rpe_config.rpe_k, rpe_config.rpe_v):
            if c is not None and c.get("skip", skip) != skip:
                raise ValueError(f"[rpe.torch] rpe_config skip = {c.get('skip')}; the model has {skip} prefix tokens "
                                 f"(get_rpe_config(..., skip={skip}))")
    model_rope = getattr(model, "rope", None)
    shared = getattr(model, "rel_pos_bias", None)
    blocks = list(getattr(model, "blocks", []))
    count, unsupported = 0, []
    for name, m in model.named_modules():
        cls = type(m)
        if cls in _BACK:
            continue  # already swapped
        if cls not in _SWAPS:
            for key, why in UNSUPPORTED.items():
                if cls.__name__ == key.split(".")[-1] and key.split(".")[0] in cls.__module__:
                    unsupported.append(f"{name} ({cls.__name__}: {why})")
            continue
        if cls in (_eva.EvaAttention, _TimmAttentionRope):
            layer = next((i for i, blk in enumerate(blocks) if getattr(blk, "attn", None) is m), 0)
            if model_rope is not None:
                kind, spec = _rope_of(model_rope, layer, m.num_prefix_tokens, bool(getattr(m, "rotate_half", False)))
                m.__dict__["_rpe_rope"] = (kind, spec)
                m.__dict__["_rpe_rope_module"] = model_rope
            if grid is None and model_rope is not None:
                raise NotImplementedError(f"[rpe.torch] {name}: the model's patch grid is unknown")
        if cls is _TimmAttention:
            if rpe_config is not None:
                if grid is None:
                    raise NotImplementedError(f"[rpe.torch] {name}: iRPE needs the model's patch grid (patch_embed.grid_size)")
                rq, rk, rv = build_rpe(rpe_config, m.head_dim, m.num_heads)
                m.rpe_q, m.rpe_k, m.rpe_v = rq, rk, rv
                m.__dict__["_rpe_skip"] = skip
        if cls is _beit.Attention and shared is not None:
            m.__dict__["_rpe_shared"] = shared
        if grid is not None:
            m.__dict__["_rpe_grid"] = grid
        if recorder is not None:
            m.__dict__["_rpe_grid_recorder"] = recorder
        m.__class__ = _SWAPS[cls]
        count += 1
    if count == 0:
        why = "; ".join(unsupported) if unsupported else "no attention module of a supported timm class"
        raise NotImplementedError(f"[rpe.torch] {type(model).__name__}: nothing to swap ({why})")
    if unsupported:
        warnings.warn(f"[rpe.torch] {type(model).__name__}: {count} attention modules swapped; these stay timm's: "
                      + "; ".join(unsupported), stacklevel=2)
    return model


def restore_attention(model):
    """Puts timm's own attention classes back (the iRPE modules that ``rpe_config`` added stay as
    submodules and are then unused) and removes the grid hook of a ``dynamic_img_size`` model.
    Returns the model."""
    for m in model.modules():
        if type(m) in _BACK:
            m.__class__ = _BACK[type(m)]
            m.__dict__.pop("_rpe_grid_recorder", None)
        for key, hook in list(m._forward_hooks.items()):
            if isinstance(hook, _GridRecorder):
                del m._forward_hooks[key]
    return model


def swapped(model):
    """The names of the model's attention modules that run rpe_torch's attention."""
    return [name for name, m in model.named_modules() if type(m) in _BACK]
