"""The digits DeiT (examples/vit_digits) for the rpe_torch tests: tools/ref_digits_model.py's model
(written against the reference's irpe API, which takes the iRPE package as a parameter) built with
rpe_torch, with the pure PyTorch modules of pure_irpe.py, or with rpe_torch's fused attention."""
import sys

import numpy as np
import torch

from conftest import DIGITS, ROOT

sys.path.insert(0, str(ROOT / "tools"))
import ref_digits_model as ref  # noqa: E402

import rpe_torch  # noqa: E402


class ModuleAttention(ref._Attention):
    """The reference's attention step composed from the iRPE modules (as RPEAttention.forward),
    without tools/ref_digits_model.py's in-place scaling so that it trains under autograd."""

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        logits = q @ k.transpose(-2, -1)
        if self.rpe_k is not None:
            logits = logits + self.rpe_k(q)
        if self.rpe_q is not None:
            logits = logits + self.rpe_q(k * self.scale).transpose(2, 3)
        a = logits.softmax(dim=-1)
        out = a @ v
        if self.rpe_v is not None:
            out = out + self.rpe_v(a)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class FusedAttention(ref._Attention):
    """The same parameters as the reference's attention; the attention step through rpe_torch.attention."""

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = rpe_torch.attention(q, k, v, self.rpe_q, self.rpe_k, self.rpe_v, scale=self.scale)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


def build(irpe, which, fused=False):
    """(model, meta) of digits model `which` ("a" or "b") with the package irpe, weights loaded
    from its safetensors with strict=True."""
    tensors, meta = ref.read_safetensors(DIGITS / f"deit_irpe_digits_{which}.safetensors")
    model = ref.DigitsDeiT(irpe, meta)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
    for blk in model.blocks:
        blk.attn.__class__ = FusedAttention if fused else ModuleAttention
    return model, meta


def images():
    return torch.from_numpy(np.load(DIGITS / "test_images.npy")), torch.from_numpy(np.load(DIGITS / "test_labels.npy"))
