"""The digits models rebuilt in PyTorch with rpe_torch.build_rpe, loaded from their safetensors with
strict=True, give the reference's logits (the C++ demo's tolerance: 1e-4 float32, 1e-9 float64);
and a short training run through rpe_torch follows the same run through the pure PyTorch modules."""
import copy

import numpy as np
import pytest
import torch

import pure_irpe
import rpe_torch
from conftest import DIGITS, assert_close
from digits_model import build, images


@pytest.mark.parametrize("which", ["a", "b"])
def test_pure_bucket_ids_equal_the_shipped_ones(which):
    _, meta = build(rpe_torch, which)
    method = {"product": pure_irpe.METHOD.PRODUCT, "euc": pure_irpe.METHOD.EUCLIDEAN}[meta["rpe_method"]]
    r = float(meta["rpe_ratio"])
    (ids,) = pure_irpe.bucket_ids(method, r, 2 * r, 8 * r, 1, 8, 8)
    assert np.array_equal(ids.numpy(), np.load(DIGITS / f"bucket_ids_{which}.npy"))
    ours = rpe_torch.bucket_ids(meta["rpe_method"], r, 2 * r, 8 * r, 1, 8, 8)[0]
    assert np.array_equal(ours.numpy(), np.load(DIGITS / f"bucket_ids_{which}.npy"))


@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused"])
@pytest.mark.parametrize("which", ["a", "b"])
def test_logits_equal_the_reference(which, fused):
    model, meta = build(rpe_torch, which, fused)
    x, labels = images()
    with torch.no_grad():
        logits = model.eval()(x)
    expected = np.load(DIGITS / f"logits_{which}.npy")
    assert_close(logits, expected, 1e-4, 0.0, f"model {which} logits")
    assert (logits.argmax(1).numpy() == expected.argmax(1)).all()
    assert int((logits.argmax(1) == labels).sum()) == int(meta["test_correct"].split("/")[0])
    with torch.no_grad():
        logits64 = model.double()(x.double())
    assert_close(logits64, np.load(DIGITS / f"logits_{which}_f64.npy"), 1e-9, 0.0, f"model {which} float64 logits")


def train(model, steps, batch=64, seed=0):
    """Losses of `steps` AdamW steps (float64) on fixed batches of the shipped images."""
    x, y = images()
    x = x.double()
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    losses = []
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (batch,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx], label_smoothing=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("which", ["a", "b"])
def test_training_follows_the_pure_pytorch_modules(which):
    pure, _ = build(pure_irpe, which)
    ours, _ = build(rpe_torch, which)
    fused, _ = build(rpe_torch, which, fused=True)
    base = copy.deepcopy(pure.state_dict())
    losses = {}
    for name, model in (("pure", pure), ("modules", ours), ("fused", fused)):
        model.double()
        losses[name] = train(model, steps=5, batch=32)
    assert losses["pure"][0] != losses["pure"][-1]  # it trains
    np.testing.assert_allclose(losses["modules"], losses["pure"], rtol=1e-10, atol=0)
    np.testing.assert_allclose(losses["fused"], losses["pure"], rtol=1e-10, atol=0)
    moved = 0
    for name, p in pure.state_dict().items():
        np.testing.assert_allclose(fused.state_dict()[name].numpy(), p.numpy(), rtol=1e-8, atol=1e-10, err_msg=name)
        if "rpe" in name:
            moved += int(not torch.equal(p, base[name].double()))
    assert moved > 0  # the tables were trained too
