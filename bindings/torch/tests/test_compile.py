"""torch.compile(fullgraph=True) and torch.export of models built on rpe_torch: the digits DeiT
with iRPE (model b, 2 blocks, contextual iRPE on q, k, v with a class token), both as the
reference's module composition and through the fused attention, a small RoPE-Mixed ViT block
on rpe_torch.attention, and blocks with the newer RoPE options (DINOv3, layout half, per-token
positions, a suffix; V-JEPA 2 on a clip of two frames). No graph break (fullgraph), logits and gradients equal to eager; the
exported program saves, loads and gives the same outputs. Shapes are tiny: compiling is the cost."""
import io

import pytest
import torch
from torch import nn

import rpe_torch
from digits_model import build, images


def digits(fused):
    model, _ = build(rpe_torch, "b", fused)
    x, _ = images()
    return model.double().train(), x[:3].double()


class RoPEBlock(nn.Module):
    """A pre-norm attention block with RoPE-Mixed (learned frequencies) and a bias term on k."""

    def __init__(self, dim=16, heads=2, side=3):
        super().__init__()
        self.heads, self.side = heads, side
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.rope = rpe_torch.RoPEMixed(heads, dim // heads, skip=1)
        cfg = rpe_torch.get_rpe_config(ratio=1.0, method="product", mode="bias", shared_head=False, skip=1, rpe_on="k")
        self.rpe_q, self.rpe_k, self.rpe_v = rpe_torch.build_rpe(cfg, dim // heads, heads)
        with torch.no_grad():
            self.rpe_k.lookup_table_bias.normal_()

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = rpe_torch.attention(q, k, v, self.rpe_q, self.rpe_k, self.rpe_v, height=self.side, width=self.side,
                                  rope=self.rope)
        return x + self.proj(out.transpose(1, 2).reshape(b, n, c))


def rope_model():
    torch.manual_seed(0)
    return RoPEBlock().double(), torch.randn(2, 10, 16, dtype=torch.float64)


class RoPEOptionsBlock(nn.Module):
    """An attention block with the newer RoPE options: DINOv3 (layout half, a sampled
    augmentation) or RoPE-Mixed in layout half, at per-token positions (a buffer: real-valued
    query positions, integer key positions) with one unrotated trailing token."""

    def __init__(self, rope, dim=16, heads=2, tokens=9):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.rope = rope
        g = torch.Generator().manual_seed(1)
        self.register_buffer("positions", torch.rand(tokens, 2, generator=g, dtype=torch.float64) * 4 - 1)
        self.register_buffer("key_positions", torch.randint(0, 3, (tokens, 2), generator=g))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = rpe_torch.attention(q, k, v, rope=self.rope, positions=self.positions, key_positions=self.key_positions)
        return x + self.proj(out.transpose(1, 2).reshape(b, n, c))


def rope_options_model(kind):
    torch.manual_seed(0)
    if kind == "dinov3":
        rope = rpe_torch.RoPEDinoV3(8, min_period=0.5, max_period=20.0, shift=(0.1, -0.1), jitter=(0.9, 1.1),
                                    rescale=1.2, skip=1, suffix=1)
    else:
        rope = rpe_torch.RoPEMixed(2, 8, skip=1, layout="half", suffix=1)
    return RoPEOptionsBlock(rope).double(), torch.randn(2, 11, 16, dtype=torch.float64)


class VJEPA2Block(nn.Module):
    """An attention block with V-JEPA 2's RoPE on a clip of 2 frames of 2 x 2 tokens after a class
    token: the module makes the clip's (frame, row, col) ids inside forward."""

    def __init__(self, dim=28, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.rope = rpe_torch.RoPEVJEPA2(grid_depth=2, grid_size=2, head_dim=dim // heads, skip=1)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        return x + rpe_torch.attention(q, k, v, rope=self.rope).transpose(1, 2).reshape(b, n, c)


def vjepa2_model():
    torch.manual_seed(0)
    return VJEPA2Block().double(), torch.randn(2, 9, 28, dtype=torch.float64)


class SlotBlock(nn.Module):
    """An attention block whose term is a TermSlot built inside forward (as a user passes a
    learned table each call) or one of the ViT modules that build one per call (RelPosBias,
    ALiBi2D, DecomposedRelPos): the registry's string lookups must not break the graph."""

    def __init__(self, kind, dim=16, heads=2, side=3):
        super().__init__()
        self.kind, self.heads, self.side = kind, heads, side
        self.qkv = nn.Linear(dim, 3 * dim)
        if kind == "slot":
            self.table = nn.Parameter(torch.randn(heads, (2 * side - 1) ** 2) * 0.1)
        elif kind == "swin":
            self.term = rpe_torch.RelPosBias(side, heads)
        elif kind == "alibi":
            self.term = rpe_torch.ALiBi2D(heads, side, side, dtype=torch.float64)
        else:
            self.term = rpe_torch.DecomposedRelPos(side, side, dim // heads)
        for p in self.parameters():
            if p.dim() == 2 and p is not self.qkv.weight:
                nn.init.normal_(p, std=0.1)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        term = rpe_torch.TermSlot("swin", [self.table], window=(self.side, self.side)) if self.kind == "slot" else self.term
        out = rpe_torch.attention(q, k, v, None, term, None, height=self.side, width=self.side)
        return x + out.transpose(1, 2).reshape(b, n, c)


def slot_model(kind):
    torch.manual_seed(0)
    return SlotBlock(kind).double(), torch.randn(2, 9, 16, dtype=torch.float64)


MODELS = {"deit_irpe_modules": lambda: digits(False), "deit_irpe_fused": lambda: digits(True), "rope": rope_model,
          "rope_dinov3_positions": lambda: rope_options_model("dinov3"),
          "rope_mixed_half_positions": lambda: rope_options_model("mixed"), "rope_vjepa2_clip": vjepa2_model,
          **{f"term_{kind}": (lambda kind=kind: slot_model(kind)) for kind in ("slot", "swin", "alibi", "decomposed")}}


def logits_and_grads(model, x, run=None):
    """Logits of run(x) (default: the model) and the model's parameter gradients."""
    model.zero_grad(set_to_none=True)
    out = (run if run is not None else model)(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_compile_fullgraph_equals_eager(name, backend):
    if backend == "inductor" and name != "deit_irpe_fused":
        pytest.skip("inductor (C++ code generation, the slow part) once, on the fused DeiT; aot_eager on every model")
    torch._dynamo.reset()
    model, x = MODELS[name]()
    if backend == "inductor":
        # inductor's cold compile (about 30 CPU-s) grows with the graph: the DeiT's first block alone.
        # Its two blocks are alike (FusedAttention, contextual iRPE on q, k and v, the class token), so
        # one lowers every operator call (forward and backward) that two do; aot_eager keeps both.
        model.blocks = model.blocks[:1]
    eager_out, eager_grads = logits_and_grads(model, x)
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # fullgraph: a graph break raises
    out, grads = logits_and_grads(model, x, compiled)
    torch.testing.assert_close(out, eager_out, atol=1e-10, rtol=1e-10)
    assert grads.keys() == eager_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], eager_grads[n], atol=1e-10, rtol=1e-10, msg=n)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_export_round_trip(name, tmp_path):
    model, x = MODELS[name]()
    model.eval()
    with torch.no_grad():
        expected = model(x)
    exported = torch.export.export(model, (x,))
    names = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert any(t.startswith("rpe.") for t in names), names  # the operators are in the graph, not decomposed
    path = tmp_path / f"{name}.pt2"
    torch.export.save(exported, path)
    loaded = torch.export.load(path)
    torch.testing.assert_close(loaded.module()(x), expected, atol=0, rtol=0)
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.export.load(buffer).module()(x), expected, atol=0, rtol=0)


def test_device_checks_trace_without_a_graph_break():
    """rpe_torch.attention's device checks read has_cuda_kernels() (a CUDA tensor's path): a plain
    bool read when the library loaded, so dynamo traces it (the dispatcher query it once called
    per check broke the graph: seen on a GPU, torch.compile(fullgraph=True) of a CUDA model)."""
    torch._dynamo.reset()

    def f(x):
        return x + 1 if rpe_torch.has_cuda_kernels() else x - 1

    x = torch.arange(3.0)
    expected = x + 1 if rpe_torch.has_cuda_kernels() else x - 1
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(x), expected, atol=0, rtol=0)
