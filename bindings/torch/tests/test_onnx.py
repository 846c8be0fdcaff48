"""ONNX export (torch.onnx.export) of models built on rpe_torch: the digits DeiT with contextual
iRPE on q, k, v and a class token (model a, trained weights), as the reference's module composition (iRPE modules
through rpe_torch.term) and through rpe_torch.attention; a block with bias terms, masks and a
Cross term. The exported graph holds standard ONNX operators only (no rpe.* node, so no rpe
library is needed to run it) and ONNX Runtime gives eager's logits. Arguments the export does not
compose raise NotImplementedError naming them."""
import io

import pytest
import torch
from torch import nn

import rpe_torch
from digits_model import build, images

import onnx  # noqa: E402  (bindings/torch/requirements.txt: onnx, onnxruntime, onnxscript)
import onnxruntime as ort  # noqa: E402

# both exporters of the pinned torch: the dynamo-based one (torch.export, the default of torch
# 2.9+) and the TorchScript-based one
EXPORTERS = [True, False]


def export(model, args, dynamo, **kw):
    f = io.BytesIO()
    torch.onnx.export(model, args, f, dynamo=dynamo, **kw)
    return f.getvalue()


def run(blob, *inputs):
    sess = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return [torch.from_numpy(o) for o in sess.run(None, {n: t.numpy() for n, t in zip(names, inputs)})]


def domains(blob):
    """The operator domains of the graph and its functions ('' is ONNX's own)."""
    m = onnx.load_from_string(blob)
    ds = {n.domain for n in m.graph.node}
    for fn in m.functions:
        ds |= {n.domain for n in fn.node}
    return ds


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("fused", [False, True])
def test_digits_model_exports_and_runs(fused, dynamo):
    model, _ = build(rpe_torch, "a", fused)  # the trained model a: contextual iRPE on q, k and v
    model.eval()
    x, _ = images()
    x = x[:4].float()
    with torch.no_grad():
        want = model(x)
    # the batch dimension dynamic: the graph's ids are constants of the grid, not of the batch
    dyn = ({"dynamic_shapes": {"x": {0: torch.export.Dim("batch")}}} if dynamo else
           {"input_names": ["x"], "dynamic_axes": {"x": {0: "batch"}}})
    blob = export(model, (x,), dynamo, **dyn)
    assert domains(blob) <= {"", "ai.onnx", "pkg.onnxscript.torch_lib.common", "pkg.onnxscript.torch_lib"}, domains(blob)
    got, = run(blob, x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # another batch, of another size, through the same graph
    x2 = images()[0][4:11].float()
    with torch.no_grad():
        torch.testing.assert_close(run(blob, x2)[0], model(x2), rtol=1e-4, atol=1e-4)
    # eager still runs rpe's operators after an export
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)


class MaskedBlock(nn.Module):
    """rpe_torch.attention with a per-head bias term on k (skip 1), a Cross contextual term on q,
    a key padding mask and an additive mask."""

    def __init__(self, heads=2, dim=8, side=3):
        super().__init__()
        self.side = side
        cfg_k = rpe_torch.get_rpe_config(ratio=1.0, method=rpe_torch.METHOD.EUCLIDEAN, mode="bias", shared_head=False,
                                         skip=1, rpe_on="k")
        cfg_q = rpe_torch.get_rpe_config(ratio=1.0, method=rpe_torch.METHOD.CROSS, mode="contextual", shared_head=True,
                                         skip=1, rpe_on="q")
        _, self.rpe_k, _ = rpe_torch.build_rpe(cfg_k, dim, heads)
        self.rpe_q, _, _ = rpe_torch.build_rpe(cfg_q, dim, heads)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()

    def forward(self, q, k, v, kpm, mask):
        return rpe_torch.attention(q, k, v, rpe_q=self.rpe_q, rpe_k=self.rpe_k, height=self.side, width=self.side,
                                   key_padding_mask=kpm, attn_mask=mask)


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_masks_bias_and_cross_terms(dynamo):
    torch.manual_seed(1)
    block = MaskedBlock().eval()
    q, k, v = (torch.randn(2, 2, 10, 8) for _ in range(3))
    kpm = torch.zeros(2, 10, dtype=torch.bool)
    kpm[1, 7:] = True
    kpm[0, :] = True  # batch element 0 without a key: zeros, as rpe's kernels give (softmax alone: NaN)
    mask = torch.randn(10, 10)
    with torch.no_grad():
        want = block(q, k, v, kpm, mask)
    blob = export(block, (q, k, v, kpm, mask), dynamo)
    got, = run(blob, q, k, v, kpm, mask)
    assert torch.all(want[0] == 0) and want[1].abs().sum() > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class VitTermBlock(nn.Module):
    """rpe_torch.attention with a ViT term module on k (its own grid)."""

    def __init__(self, kind):
        super().__init__()
        self.term = (rpe_torch.ALiBi2D(2, 3, 3, skip=1) if kind == "alibi" else rpe_torch.RelPosBias((3, 4), 2, kind="swin"))
        with torch.no_grad():
            for p in self.term.parameters():
                p.normal_()

    def forward(self, q, k, v):
        return rpe_torch.attention(q, k, v, rpe_k=self.term)


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_alibi_term(dynamo):
    torch.manual_seed(2)
    block = VitTermBlock("alibi").eval()
    q, k, v = (torch.randn(2, 2, 10, 8) for _ in range(3))
    with torch.no_grad():
        want = block(q, k, v)
        plain = rpe_torch.attention(q, k, v)
    assert (want - plain).abs().max() > 1e-3  # the term contributes
    got, = run(export(block, (q, k, v), dynamo), q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class RoPEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.rope = rpe_torch.RoPEAxial(8, skip=1)

    def forward(self, q, k, v):
        return rpe_torch.attention(q, k, v, rope=self.rope, height=3, width=3)


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_unsupported_arguments_are_named(dynamo):
    q = torch.randn(1, 2, 10, 8)
    with pytest.raises(Exception, match=r"rope is given while exporting to ONNX"):
        export(RoPEBlock().eval(), (q, q, q), dynamo)
    q = torch.randn(1, 2, 12, 8)
    with pytest.raises(Exception, match=r"rpe_k = a RelPosBias \(its tables come from rpe operators"):
        export(VitTermBlock("swin").eval(), (q, q, q), dynamo)


class ConfigBlock(nn.Module):
    """iRPE on q, k and v (v only for contextual) of one configuration, through the modules (the
    reference's composition) and through rpe_torch.attention; returns both."""

    def __init__(self, method, mode, shared, skip, heads=2, dim=8):
        super().__init__()
        cfg = rpe_torch.get_rpe_config(ratio=1.3, method=method, mode=mode, shared_head=shared, skip=skip,
                                       rpe_on="qkv" if mode == "contextual" else "qk")
        self.rpe_q, self.rpe_k, self.rpe_v = rpe_torch.build_rpe(cfg, dim, heads)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()

    def forward(self, q, k, v):
        s = q.shape[-1] ** -0.5
        logits = (q * s) @ k.transpose(-2, -1) + self.rpe_k(q * s, 4, 5) + self.rpe_q(k * s, 4, 5).transpose(2, 3)
        a = logits.softmax(dim=-1)
        out = a @ v
        if self.rpe_v is not None:
            out = out + self.rpe_v(a, 4, 5)
        return out, rpe_torch.attention(q, k, v, self.rpe_q, self.rpe_k, self.rpe_v, height=4, width=5)


@pytest.mark.parametrize("method,mode,shared,skip", [
    (m, mode, shared, skip) for m in (rpe_torch.METHOD.EUCLIDEAN, rpe_torch.METHOD.QUANT, rpe_torch.METHOD.CROSS,
                                      rpe_torch.METHOD.PRODUCT)
    for mode in ("bias", "contextual") for shared in (True, False) for skip in (0, 1)])
def test_every_irpe_configuration(method, mode, shared, skip):
    """Every mapping, mode, shared / per-head tables and skip, on a 4 × 5 grid (TorchScript-based
    exporter: the quicker one; the dynamo-based one is covered above)."""
    torch.manual_seed(3)
    block = ConfigBlock(method, mode, shared, skip).eval()
    L = skip + 20
    q, k, v = (torch.randn(2, 2, L, 8) for _ in range(3))
    with torch.no_grad():
        want = block(q, k, v)
    torch.testing.assert_close(want[0], want[1], rtol=1e-5, atol=1e-5)  # the two routes agree in eager
    got = run(export(block, (q, k, v), False), q, k, v)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
