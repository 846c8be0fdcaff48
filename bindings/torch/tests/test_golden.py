"""rpe_torch's drop-in modules and fused attention against the reference's golden cases
(tests/data/golden, format in its README): bucket ids exactly; outputs and gradients in float32
and float64 within each case's tolerance."""
import json

import numpy as np
import pytest
import torch

import rpe_torch as irpe
from conftest import GOLDEN, assert_close

NAMES = {"euclidean": irpe.METHOD.EUCLIDEAN, "quantization": irpe.METHOD.QUANT, "product": irpe.METHOD.PRODUCT,
         "cross": irpe.METHOD.CROSS}


def cases(kind):
    return sorted(p.parent for p in (GOLDEN / kind).glob("*/meta.json"))


def load(case, name, dtype):
    return torch.from_numpy(np.load(case / name)).to(dtype)


def config(meta):
    """A reference-style single config from a case's meta (alpha, beta, gamma as given)."""
    c = irpe.RPEConfig(shared_head=meta["shared_head"], mode=meta["mode"], method=NAMES[meta["method"]],
                       alpha=meta["alpha"], beta=meta["beta"], gamma=meta["gamma"])
    c.num_buckets = meta["num_buckets"]
    return c


def tol(meta, name, f64):
    t = meta["tolerance"]
    base = name.replace("_f64.npy", ".npy")
    atol = t["per_file"][base]["atol_float64" if f64 else "atol_float32"]
    return atol, t["rtol_float64" if f64 else "rtol_float32"]


def set_tables(module, case, tables, dtype):
    """Loads the case's table(s) into the module (reference parameter names)."""
    subs = [module.rp_rows, module.rp_cols] if isinstance(module, irpe.iRPE_Cross) else [module]
    assert len(subs) == len(tables)
    with torch.no_grad():
        for sub, entry in zip(subs, tables):
            p = sub.lookup_table_bias if sub.mode == "bias" else sub.lookup_table_weight
            t = load(case, entry["table"], dtype)
            assert p.shape == t.shape, f"{entry['table']}: parameter {tuple(p.shape)}, file {tuple(t.shape)}"
            p.copy_(t)
    return [s.lookup_table_bias if s.mode == "bias" else s.lookup_table_weight for s in subs]


@pytest.mark.parametrize("case", cases("bucket_ids"), ids=lambda p: p.name)
def test_bucket_ids(case):
    meta = json.loads((case / "meta.json").read_text())
    ids = irpe.bucket_ids(meta["method"], meta["alpha"], meta["beta"], meta["gamma"], meta["skip"], meta["height"],
                          meta["width"])
    files = ["bucket_ids_rows.npy", "bucket_ids_cols.npy"] if meta["method"] == "cross" else ["bucket_ids.npy"]
    assert ids.shape[0] == len(files)
    for t, f in enumerate(files):
        assert np.array_equal(ids[t].numpy(), np.load(case / f)), f


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", cases("term"), ids=lambda p: p.name)
def test_term(case, dtype):
    meta = json.loads((case / "meta.json").read_text())
    f64 = dtype == torch.float64
    cfg = config(meta)
    cls = irpe.iRPE_Cross if meta["method"] == "cross" else irpe.iRPE
    module = cls(head_dim=meta["head_dim"], num_heads=meta["table_heads"], mode=meta["mode"], method=cfg.method,
                 transposed=meta["target"] != "v", num_buckets=meta["num_buckets"], rpe_config=cfg).to(dtype)
    params = set_tables(module, case, meta["tables"], dtype)
    x = load(case, "x.npy", dtype).requires_grad_() if meta["mode"] == "contextual" else None
    if x is None:  # bias mode: the reference reads only B and L of x
        L = meta["L"]
        x_in = torch.zeros(meta["batch"], meta["heads"], L, meta["head_dim"], dtype=dtype)
    else:
        x_in = x
    out = module(x_in, height=meta["height"], width=meta["width"])
    if meta["target"] == "q":
        out = out.transpose(2, 3)  # as the attention uses rpe_q
    grad_output = load(case, "grad_output.npy", dtype)
    (out * grad_output).sum().backward()
    sfx = "_f64.npy" if f64 else ".npy"
    for entry in meta["compare"]:
        name = entry["expected_f64"] if f64 else entry["expected"]
        what = entry["what"]
        if what == "output":
            actual = out
        elif what == "grad_input":
            actual = x.grad
        else:
            idx = [t["grad"].replace(".npy", "") for t in meta["tables"]].index(what)
            actual = params[idx].grad
        assert_close(actual, np.load(case / name), *tol(meta, name, f64), f"{case.name} {name}")
    assert sfx  # both precisions compared above


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", cases("attention"), ids=lambda p: p.name)
def test_attention(case, dtype):
    meta = json.loads((case / "meta.json").read_text())
    f64 = dtype == torch.float64
    cfg = irpe.get_rpe_config(ratio=meta["ratio"], method=NAMES[meta["method"]], mode=meta["mode"],
                              shared_head=meta["shared_head"], skip=meta["skip"], rpe_on=meta["rpe_on"])
    rpe_q, rpe_k, rpe_v = [m.to(dtype) if m is not None else None
                           for m in irpe.build_rpe(cfg, head_dim=meta["head_dim"], num_heads=meta["heads"])]
    params = {}
    for letter, m in zip("qkv", (rpe_q, rpe_k, rpe_v)):
        if m is not None:
            for entry, p in zip(meta["rpe"][letter]["tables"], set_tables(m, case, meta["rpe"][letter]["tables"], dtype)):
                params[entry["grad"].replace(".npy", "")] = p
    q, k, v = (load(case, f"{n}.npy", dtype).requires_grad_() for n in "qkv")
    kpm = load(case, "key_padding_mask.npy", torch.uint8).bool() if meta.get("key_padding_mask") else None
    out = irpe.attention(q, k, v, rpe_q, rpe_k, rpe_v, height=meta["height"], width=meta["width"], key_padding_mask=kpm)
    (out * load(case, "grad_output.npy", dtype)).sum().backward()
    actual = {"output": out, "grad_q": q.grad, "grad_k": k.grad, "grad_v": v.grad}
    compared = 0
    for entry in meta["compare"]:
        what = entry["what"]
        if what == "attn":
            continue  # the fused kernels never form the probabilities as a tensor
        name = entry["expected_f64"] if f64 else entry["expected"]
        got = actual[what] if what in actual else params[what].grad
        assert_close(got, np.load(case / name), *tol(meta, name, f64), f"{case.name} {name}")
        compared += 1
    assert compared >= 5


def test_bias_on_values_is_rejected():
    meta = json.loads((GOLDEN / "errors" / "bias_on_v" / "meta.json").read_text())
    cfg = irpe.get_rpe_config(ratio=meta["ratio"], method="product", mode="bias", skip=meta["skip"], rpe_on="v")
    with pytest.raises(NotImplementedError, match="Bias non-transposed RPE does not exist"):
        irpe.build_rpe(cfg, head_dim=meta["head_dim"], num_heads=meta["heads"])
