"""The digits demo's DeiT + iRPE model in PyTorch, around the reference's own ``irpe.build_rpe``.

Used by ``tools/compare_reference.py`` to run the job of ``examples/vit_digits`` through the
reference implementation (microsoft/Cream, ``iRPE/DeiT-with-iRPE/irpe.py``, imported by the caller
from the user's checkout and passed in as ``irpe``). The iRPE modules are the reference's; the
rest of the model is a minimal DeiT written here from the equations in
``examples/data/digits/README.md`` (parameter names of the DeiT / timm ``state_dict``, so the
shipped safetensors load with ``strict=True``): patch embedding, class token + position
embedding, pre-norm blocks (attention with iRPE, GELU MLP), final norm, head on the class token.
Inference only (no dropout, no drop-path).

Needs torch and numpy; the safetensors files are read with the standard library and numpy.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch
from torch import nn


def read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name → float32 array, __metadata__) of a safetensors file holding F32 tensors only."""
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise ValueError(f"{path}: header length {n} exceeds the file")
    header = json.loads(data[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    body = memoryview(data)[8 + n:]
    tensors = {}
    for name, info in header.items():
        if info.get("dtype") != "F32":
            raise ValueError(f"{path}: tensor {name} has dtype {info.get('dtype')}; expected F32")
        begin, end = info["data_offsets"]
        tensors[name] = np.frombuffer(body[begin:end], dtype="<f4").reshape(info["shape"]).copy()
    return tensors, meta


class _Attention(nn.Module):
    def __init__(self, irpe, dim: int, heads: int, qkv_bias: bool, rpe_config):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.rpe_q, self.rpe_k, self.rpe_v = irpe.build_rpe(rpe_config, head_dim=dim // heads, num_heads=heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q *= self.scale  # in place, as the reference's RPEAttention does (the key term sees q·s)
        logits = q @ k.transpose(-2, -1)
        if self.rpe_k is not None:
            logits += self.rpe_k(q)
        if self.rpe_q is not None:
            logits += self.rpe_q(k * self.scale).transpose(2, 3)
        a = logits.softmax(dim=-1)
        out = a @ v
        if self.rpe_v is not None:
            out += self.rpe_v(a)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Block(nn.Module):
    def __init__(self, irpe, dim: int, heads: int, hidden: int, qkv_bias: bool, eps: float, rpe_config):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = _Attention(irpe, dim, heads, qkv_bias, rpe_config)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = _Mlp(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, in_chans: int, dim: int, patch: int):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, grid·grid, C), row-major grid order


class DigitsDeiT(nn.Module):
    """DeiT with iRPE as configured by a digits safetensors file's metadata."""

    def __init__(self, irpe, meta: dict[str, str]):
        super().__init__()
        dim, patch, img = int(meta["embed_dim"]), int(meta["patch_size"]), int(meta["img_size"])
        tokens = (img // patch) ** 2 + 1
        rpe_config = irpe.get_rpe_config(
            ratio=float(meta["rpe_ratio"]), method=meta["rpe_method"],
            mode="ctx" if meta["rpe_mode"] == "contextual" else meta["rpe_mode"],
            shared_head=meta["rpe_shared_head"] == "true", skip=int(meta["rpe_skip"]), rpe_on=meta["rpe_on"])
        hidden = int(meta.get("mlp_hidden_dim") or int(dim * float(meta["mlp_ratio"])))
        eps = float(meta["layer_norm_eps"])
        self.patch_embed = _PatchEmbed(int(meta["in_chans"]), dim, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens, dim))
        self.blocks = nn.ModuleList(
            _Block(irpe, dim, int(meta["num_heads"]), hidden, meta["qkv_bias"] == "true", eps, rpe_config)
            for _ in range(int(meta["depth"])))
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.head = nn.Linear(dim, int(meta["num_classes"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def load_model(irpe, path: Path) -> tuple[DigitsDeiT, dict[str, str]]:
    """The model of a digits safetensors file, weights loaded (strict), in eval mode."""
    tensors, meta = read_safetensors(path)
    if meta.get("class_token", "true") != "true":
        raise ValueError(f"{path}: class_token = {meta.get('class_token')}; this model definition needs one")
    model = DigitsDeiT(irpe, meta)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
    return model.eval(), meta
