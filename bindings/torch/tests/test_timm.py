"""rpe_torch.timm: timm's own models (random init, no download, 2 blocks, small images) with
``swap_attention`` give timm's logits and parameter gradients, in eval and train mode (dropout 0).

Tolerance: float64, |diff| <= 1e-10 + 1e-8·|timm| for logits and every parameter gradient (the
two differ only by the order of float sums); for the RoPE families (EVA-02, rope-vit)
1e-7 + 1e-6·|timm|: timm computes its sin/cos tables in float32 also in a float64 model (its
values are float32 numbers), rpe in the model's dtype. The parameters are timm's init plus N(0, 0.05)
noise, so that zero-initialised tables (BEiT, SAM) are exercised. ViT / DeiT with iRPE has no
timm counterpart: it is compared with the reference's RPEAttention formula (q·s·kᵀ + rpe_k(q·s)
+ rpe_q(k·s)ᵀ, softmax, + rpe_v(attn)) over rpe_torch's unfused iRPE modules on the same weights.
Skipped only without timm; families rpe does not map are checked to be refused (never run)."""
import copy
import io

import pytest
import torch

timm = pytest.importorskip("timm")

import rpe_torch  # noqa: E402
import rpe_torch.timm as rt  # noqa: E402

ATOL, RTOL = 1e-10, 1e-8
ROPE_ATOL, ROPE_RTOL = 1e-7, 1e-6  # timm's float32 sin/cos tables (module docstring)
ROPE_FAMILIES = ("eva02", "rope_axial", "rope_mixed", "rope_axial_half", "dinov3")

#: family -> (timm model name, kwargs): 2 blocks (Swin, SwinV2: one stage of 2 blocks, the second
#: with shifted windows and their masks), small images.
FAMILIES = {
    "deit": ("deit_tiny_patch16_224", dict(depth=2, img_size=48)),
    "vit_qknorm": ("vit_small_patch16_224", dict(depth=2, img_size=48, embed_dim=64, num_heads=2, qk_norm=True,
                                                 class_token=True, reg_tokens=2)),
    "beit": ("beit_base_patch16_224", dict(depth=2, img_size=64, embed_dim=96, num_heads=3)),
    "swin": ("swin_tiny_patch4_window7_224", dict(img_size=56, embed_dim=32, depths=(2,), num_heads=(2,))),
    "swinv2": ("swinv2_tiny_window8_256", dict(img_size=64, embed_dim=32, depths=(2,), num_heads=(2,))),
    "eva02": ("eva02_tiny_patch14_224", dict(depth=2, img_size=56)),
    "rope_axial": ("vit_small_patch16_rope_224", dict(depth=2, img_size=64, embed_dim=96, num_heads=3)),
    "rope_mixed": ("vit_small_patch16_rope_mixed_224", dict(depth=2, img_size=64, embed_dim=96, num_heads=3)),
    "rope_axial_half": ("vit_small_patch16_rope_224", dict(depth=2, img_size=64, embed_dim=96, num_heads=3,
                                                           rope_rotate_half=True)),
    "dinov3": ("vit_small_patch16_dinov3", dict(depth=2, img_size=64, embed_dim=96, num_heads=3)),
    "sam": ("samvit_base_patch16", dict(depth=2, img_size=64, embed_dim=64, num_heads=2, window_size=2,
                                        global_attn_indexes=(1,))),
}


def make(name, kwargs, seed=0):
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, num_classes=5, drop_path_rate=0.0, **kwargs).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def run(model, x, train):
    model.train(train)
    model.zero_grad(set_to_none=True)
    out = model(x)
    if isinstance(out, (tuple, list)):
        out = out[0]
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(swapped, reference, x, atol=ATOL, rtol=RTOL):
    for train in (False, True):
        out, grads = run(swapped, x, train)
        ref, ref_grads = run(reference, x, train)
        mode = "train" if train else "eval"
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, msg=lambda m: f"logits ({mode}): {m}")
        assert grads.keys() == ref_grads.keys()
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], atol=atol, rtol=rtol,
                                       msg=lambda m, n=n: f"grad {n} ({mode}): {m}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_swap_equals_timm(family):
    name, kwargs = FAMILIES[family]
    reference = make(name, kwargs)
    swapped = rt.swap_attention(copy.deepcopy(reference))
    assert swapped.state_dict().keys() == reference.state_dict().keys()
    names = rt.swapped(swapped)
    assert names and all(type(m).__module__ == "rpe_torch.timm" for n, m in swapped.named_modules() if n in names)
    size = swapped.patch_embed.img_size
    torch.manual_seed(1)
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    compare(swapped, reference, x, *((ROPE_ATOL, ROPE_RTOL) if family in ROPE_FAMILIES else (ATOL, RTOL)))


def test_vit_float32():
    name, kwargs = FAMILIES["deit"]
    reference = make(name, kwargs).float()
    swapped = rt.swap_attention(copy.deepcopy(reference))
    x = torch.randn(2, 3, 48, 48)
    out, ref = swapped.eval()(x), reference.eval()(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


class ReferenceRPEAttention(timm.layers.Attention):
    """The reference DeiT-iRPE's RPEAttention formula on timm's Attention with rpe_torch's unfused
    iRPE modules (rpe_q, rpe_k, rpe_v) — what swap_attention(rpe_config=...) fuses."""

    def forward(self, x, attn_mask=None, is_causal=False):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        if self.rpe_k is not None:
            attn = attn + self.rpe_k(q)
        if self.rpe_q is not None:
            attn = attn + self.rpe_q(k * self.scale).transpose(2, 3)
        attn = attn.softmax(dim=-1)
        out = attn @ v
        if self.rpe_v is not None:
            out = out + self.rpe_v(attn)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("method,mode", [("product", "contextual"), ("euc", "bias"), ("cross", "contextual")])
def test_vit_irpe_equals_reference_formula(method, mode):
    name, kwargs = FAMILIES["deit"]
    cfg = rpe_torch.get_rpe_config(ratio=1.9, method=method, mode=mode, shared_head=mode == "bias", skip=1,
                                   rpe_on="qkv" if mode == "contextual" else "qk")
    swapped = rt.swap_attention(make(name, kwargs), rpe_config=cfg).double()
    with torch.no_grad():
        for n, p in swapped.named_parameters():
            if "rpe_" in n:
                p.normal_(0, 0.1)
    assert any("rpe_k" in k for k in swapped.state_dict())
    reference = copy.deepcopy(swapped)
    rt.restore_attention(reference)
    for m in reference.modules():
        if type(m) is timm.layers.Attention:
            m.__class__ = ReferenceRPEAttention
    torch.manual_seed(1)
    compare(swapped, reference, torch.randn(2, 3, 48, 48, dtype=torch.float64))


def test_refusals():
    name, kwargs = FAMILIES["deit"]
    model = rt.swap_attention(timm.create_model(name, pretrained=False, attn_drop_rate=0.1, **kwargs))
    x = torch.randn(1, 3, 48, 48)
    model.eval()(x)  # dropout is off in eval
    with pytest.raises(NotImplementedError, match="attention dropout p = 0.1"):
        model.train()(x)
    with pytest.raises(ValueError, match="prefix tokens"):
        rt.swap_attention(timm.create_model(name, pretrained=False, **kwargs),
                          rpe_config=rpe_torch.get_rpe_config(skip=0))
    with pytest.raises(NotImplementedError, match="nothing to swap"):
        rt.swap_attention(timm.create_model("resnet18", pretrained=False))
    with pytest.raises(NotImplementedError, match="RelPosAttention"):
        rt.swap_attention(timm.create_model("vit_relpos_small_patch16_224", pretrained=False, depth=1, img_size=32))


@pytest.mark.parametrize("family", ["deit", "rope_axial", "dinov3"])
def test_dynamic_img_size(family):
    """A dynamic_img_size model (DINOv3's default) at image sizes other than its own, square and
    not: the patch embedding's hook gives each forward's grid to the RoPE; equal to timm's own.
    Saved and restored, the hook goes with the model and then away."""
    name, kwargs = FAMILIES[family]
    reference = make(name, dict(kwargs, dynamic_img_size=True))
    swapped = rt.swap_attention(copy.deepcopy(reference))
    patch = reference.patch_embed.patch_size[0]
    tol = (ROPE_ATOL, ROPE_RTOL) if family in ROPE_FAMILIES else (ATOL, RTOL)
    for h, w in ((3, 5), (4, 4), (5, 2)):
        torch.manual_seed(h * w)
        compare(swapped, reference, torch.randn(1, 3, h * patch, w * patch, dtype=torch.float64), *tol)
    buffer = io.BytesIO()
    torch.save(swapped, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False).eval()
    x = torch.randn(1, 3, 2 * patch, 3 * patch, dtype=torch.float64)
    torch.testing.assert_close(loaded(x), reference.eval()(x), atol=tol[0], rtol=tol[1])
    rt.restore_attention(swapped)
    assert not swapped.patch_embed._forward_hooks


def test_restore_and_save(tmp_path):
    name, kwargs = FAMILIES["rope_mixed"]
    model = rt.swap_attention(make(name, kwargs))
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    torch.testing.assert_close(loaded.eval()(x), model.eval()(x), atol=0, rtol=0)
    rt.restore_attention(model)
    assert rt.swapped(model) == []


@pytest.mark.parametrize("family", list(FAMILIES))
def test_swapped_compiles_fullgraph(family):
    """torch.compile(fullgraph=True) of the swapped model (aot_eager): no graph break (Swin's
    shifted-window masks take the tracer's per-window path), logits and gradients equal eager.
    Tracing is the cost and grows with the blocks: the families whose two blocks are alike compile
    one; Swin and SwinV2 (the second block's shifted windows) and SAM (a windowed block, then a
    global one) keep both, whose attention paths differ."""
    name, kwargs = FAMILIES[family]
    if family not in ("swin", "swinv2", "sam"):
        kwargs = dict(kwargs, depth=1)
    model = rt.swap_attention(make(name, kwargs)).eval()
    torch.manual_seed(1)
    x = torch.randn(2, 3, *model.patch_embed.img_size, dtype=torch.float64)
    eager_out, eager_grads = run(model, x, False)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    model.zero_grad(set_to_none=True)
    out = compiled(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    torch.testing.assert_close(out.detach(), eager_out, atol=1e-12, rtol=1e-12)
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, eager_grads[n], atol=1e-12, rtol=1e-12, msg=n)
