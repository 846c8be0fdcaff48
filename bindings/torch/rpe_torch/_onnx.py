"""ONNX export of rpe_torch: the iRPE terms and the attention step composed from standard
PyTorch operators while ``torch.onnx.export`` runs (either exporter), so that the exported graph
holds only ONNX operators (Gather, MatMul, ScatterElements, Softmax, ...) and runs in any ONNX
runtime without rpe's library. Eager, compiled and exported (``torch.export``) models keep rpe's
operators; only the ONNX export takes this path. See docs/torch.md, "ONNX export".

The bucket ids enter the graph as a constant (T, L, L) int64 tensor per term (rpe's own ids,
computed once at export time; a DeiT-S grid: 197² ids, 310 KB). Supported there: the terms on a
grid whose tables are parameters or buffers (the iRPE and iRPE_Cross modules: bias and
contextual, on q, k and v, shared or per-head tables, skip tokens; ALiBi2D), ``key_padding_mask``,
``attn_mask`` and ``scale``. The rest (RoPE, per-token or packed positions, key lengths, keys of
another count, the ViT modules whose tables rpe operators make: RelPosBias, DecomposedRelPos, a
TermSlot of SwinV2's CPB) raises NotImplementedError naming the argument.
"""
from __future__ import annotations

import torch


@torch.compiler.assume_constant_result  # read while tracing (also by torch.export's strict, dynamo-based tracer)
def exporting() -> bool:
    """True while torch.onnx.export traces a model (TorchScript-based or dynamo-based exporter)."""
    return bool(torch.onnx.is_in_onnx_export())


def unsupported(name: str):
    """The NotImplementedError of an argument the ONNX export path does not compose."""
    return NotImplementedError(f"[rpe.torch] {name} is given while exporting to ONNX; the ONNX export composes the iRPE "
                               "terms on a grid, key_padding_mask, attn_mask and scale only (docs/torch.md, ONNX export)")


def constant_ids(method, alpha, beta, gamma, skip, height, width):
    """rpe's (T, L, L) bucket ids as an int64 tensor, made outside the exporter's tracing so that
    the graph holds them as a constant."""
    from .vit import _registry  # outside torch.jit.trace's tracer and torch.export's dispatch modes
    return _registry("bucket_ids", method, float(alpha), float(beta), float(gamma), int(skip), int(height),
                     int(width)).to(torch.int64)


def term(x, tables, method, mode, target, alpha, beta, gamma, skip, height, width):
    """rpe_torch.term's output from standard operators (see rpe_torch.term for the shapes): bias
    ``table[h, id(i, j)]``; contextual q/k ``(x·table)[b, h, i, id(i, j)]``; v ``Σ_j x[b, h, i, j]·
    table[h, id(i, j), :]`` (the per-bucket sums of x, then one product with the table)."""
    ids = constant_ids(method, alpha, beta, gamma, skip, height, width).to(tables[0].device)
    out = None
    for t, table in enumerate(tables):
        idt = ids[t]  # (L, L)
        if mode == "bias":  # table (Ht, K) -> (1, Ht, L, L)
            y = table[:, idt].unsqueeze(0)
        elif target == "v":  # x (B, H, L, L), table (Ht, K, D) -> (B, H, L, D)
            sums = torch.zeros(*x.shape[:3], table.shape[-2], dtype=x.dtype, device=x.device)
            sums = sums.scatter_add(-1, idt.expand(x.shape), x)
            y = torch.matmul(sums, table)
        else:  # x (B, H, L, D), table (Ht, D, K) -> (B, H, L, L)
            lut = torch.matmul(x, table)
            y = torch.gather(lut, -1, idt.expand(*lut.shape[:3], idt.shape[-1]))
        out = y if out is None else out + y
    return out


def slot_term(x, slot, target):
    """term() of an attention slot's (method, mode, tables, alpha, beta, gamma, skip, height, width)."""
    method, mode, ts, alpha, beta, gamma, skip, h, w = slot
    return term(x, ts, method, mode, target, alpha, beta, gamma, skip, h, w)


def attention(q, k, v, slots, key_padding_mask, attn_mask, scale):
    """rpe_torch.attention's output from standard operators: ``qs = q·scale``, ``logits = qs·kᵀ +
    rpe_k(qs) + rpe_q(k·scale)ᵀ + attn_mask``, padded keys −∞, ``a = softmax(logits)`` (rows
    without a key: zeros, as rpe's kernels give), ``out = a·v + rpe_v(a)``. ``slots``: the q, k, v
    slots' (method, mode, tables, alpha, beta, gamma, skip, height, width) or None."""
    s = q.shape[-1] ** -0.5 if scale is None else float(scale)
    qs = q * s
    logits = torch.matmul(qs, k.transpose(-1, -2))
    sq, sk, sv = slots
    if sk is not None:
        logits = logits + slot_term(qs, sk, "k")
    if sq is not None:
        logits = logits + slot_term(k * s, sq, "k").transpose(-1, -2)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            logits = logits.masked_fill(attn_mask, float("-inf"))
        else:
            logits = logits + attn_mask.to(logits.dtype)
    if key_padding_mask is not None:
        logits = logits.masked_fill(key_padding_mask.to(torch.bool)[:, None, None, :], float("-inf"))
    a = torch.softmax(logits, dim=-1)
    if key_padding_mask is not None or attn_mask is not None:  # a row without a key: zeros, not NaN
        dead = torch.amax(logits, dim=-1, keepdim=True) == float("-inf")
        a = torch.where(dead, torch.zeros_like(a), a)
    out = torch.matmul(a, v)
    if sv is not None:
        out = out + slot_term(a, sv, "v")
    return out
