"""A plain PyTorch implementation of the iRPE modules, written for the tests from SPEC.md and the
golden README (not from the reference's code): bucket ids by the eq. 18 recipe (float32, round
half to even), terms by gathering the tables into (L, L) form and plain einsums, autograd by
PyTorch. Same public names as the reference (get_rpe_config, build_rpe, METHOD, modules with
lookup_table_bias / lookup_table_weight), so a model written against the reference runs on it;
the rpe_torch training test compares against it."""
import math

import torch
from torch import nn


class METHOD:
    EUCLIDEAN, QUANT, PRODUCT, CROSS, CROSS_ROWS, CROSS_COLS = 0, 1, 3, 4, 41, 42


def g(x, alpha, beta, gamma):
    """Piecewise index (eq. 18) of an integer or float tensor, the reference's float32 recipe."""
    f32 = torch.float32
    xf = x.to(f32)
    a = torch.tensor(alpha, dtype=f32)
    ln = torch.tensor(math.log(gamma / alpha), dtype=f32)
    ba = torch.tensor(beta - alpha, dtype=f32)
    b = torch.tensor(beta, dtype=f32)
    ax = xf.abs()
    far = torch.sign(xf) * torch.minimum(b, torch.round(a + torch.log(ax / a) / ln * ba))
    return torch.where(ax <= a, torch.round(xf), far).trunc().long()


def bucket_ids(method, alpha, beta, gamma, skip, height, width):
    """List of (L, L) int64 id matrices (two for Cross), extra bucket K-1 for skip tokens."""
    r = torch.arange(height).repeat_interleave(width)
    c = torch.arange(width).repeat(height)
    dr, dc = r[:, None] - r[None, :], c[:, None] - c[None, :]
    bi = int(beta)
    if method == METHOD.EUCLIDEAN:
        ids, k = [g(torch.round(torch.sqrt((dr * dr + dc * dc).float())), alpha, beta, gamma) + bi], 2 * bi + 1
    elif method == METHOD.QUANT:
        ids, k = [g(dr * dr + dc * dc, alpha, beta, gamma) + bi], 2 * bi + 1
    elif method == METHOD.PRODUCT:
        ids = [(g(dr, alpha, beta, gamma) + bi) * (2 * bi + 1) + g(dc, alpha, beta, gamma) + bi]
        k = (2 * bi + 1) ** 2
    else:
        ids, k = [g(dr, alpha, beta, gamma) + bi, g(dc, alpha, beta, gamma) + bi], 2 * bi + 1
    if skip > 0:
        L = skip + height * width
        out = []
        for m in ids:
            full = torch.full((L, L), k, dtype=torch.long)
            full[skip:, skip:] = m
            out.append(full)
        ids = out
    return ids


class Config(dict):
    __getattr__ = dict.__getitem__


def get_rpe_config(ratio=1.9, method=METHOD.PRODUCT, mode="contextual", shared_head=True, skip=0, rpe_on="k"):
    if isinstance(method, str):
        method = {"euc": METHOD.EUCLIDEAN, "quant": METHOD.QUANT, "cross": METHOD.CROSS, "product": METHOD.PRODUCT}[method]
    mode = "contextual" if mode == "ctx" else mode
    bi = int(2 * ratio)
    k = ((2 * bi + 1) ** 2 if method == METHOD.PRODUCT else 2 * bi + 1) + (1 if skip > 0 else 0)
    one = Config(shared_head=shared_head, mode=mode, method=method, alpha=ratio, beta=2 * ratio, gamma=8 * ratio,
                 num_buckets=k, skip=skip)
    return Config(rpe_q=one if "q" in rpe_on else None, rpe_k=one if "k" in rpe_on else None,
                  rpe_v=one if "v" in rpe_on else None)


class PureRPE(nn.Module):
    """One table (or Cross's rows/cols pair): out = the reference module's output."""

    def __init__(self, cfg, head_dim, num_heads, transposed, method):
        super().__init__()
        self.cfg, self.transposed, self.method = cfg, transposed, method
        k = cfg.num_buckets
        if cfg.mode == "bias":
            self.lookup_table_bias = nn.Parameter(torch.zeros(num_heads, k))
        elif transposed:
            self.lookup_table_weight = nn.Parameter(torch.zeros(num_heads, head_dim, k))
        else:
            self.lookup_table_weight = nn.Parameter(torch.zeros(num_heads, k, head_dim))

    def forward(self, x, height=None, width=None, ids=None):
        L = x.shape[2]
        if height is None:
            height = width = math.isqrt(L - self.cfg.skip)
        c = self.cfg
        if ids is None:
            (ids,) = bucket_ids(self.method, c.alpha, c.beta, c.gamma, L - height * width, height, width)
        if c.mode == "bias":
            return self.lookup_table_bias[:, ids][None]  # (1, Ht, L, L)
        if self.transposed:  # (Ht, D, K) -> (Ht, L, L, D); out[b,h,i,j] = x[b,h,i,:]·T[h,:,id(i,j)]
            t = self.lookup_table_weight.permute(0, 2, 1)[:, ids]
            return torch.einsum("bhid,hijd->bhij", x, t)
        t = self.lookup_table_weight[:, ids]  # (Ht, L, L, D)
        return torch.einsum("bhij,hijd->bhid", x, t)


class PureCross(nn.Module):
    def __init__(self, cfg, head_dim, num_heads, transposed):
        super().__init__()
        self.cfg = cfg
        self.rp_rows = PureRPE(cfg, head_dim, num_heads, transposed, METHOD.CROSS)
        self.rp_cols = PureRPE(cfg, head_dim, num_heads, transposed, METHOD.CROSS)

    def forward(self, x, height=None, width=None):
        L, c = x.shape[2], self.cfg
        if height is None:
            height = width = math.isqrt(L - c.skip)
        rows, cols = bucket_ids(METHOD.CROSS, c.alpha, c.beta, c.gamma, L - height * width, height, width)
        return self.rp_rows(x, height, width, rows) + self.rp_cols(x, height, width, cols)


def build_rpe(config, head_dim, num_heads):
    def one(cfg, transposed):
        if cfg is None:
            return None
        heads = 1 if cfg.shared_head else num_heads
        if cfg.method == METHOD.CROSS:
            return PureCross(cfg, head_dim, heads, transposed)
        return PureRPE(cfg, head_dim, heads, transposed, cfg.method)

    return [one(config.rpe_q, True), one(config.rpe_k, True), one(config.rpe_v, False)]
