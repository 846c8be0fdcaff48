"""rpe's registry of term families from Python: the names come from the C++ library
(torch.ops.rpe.families), a spec text works as a method, and a user's own mapping registered in a
plugin (examples/01_custom_mapping/manhattan.cpp, RPE_EXAMPLE_MANHATTAN) is reached by name after
torch.ops.load_library."""
import os

import pytest
import torch

import rpe_torch as rt

PLUGIN = os.environ.get("RPE_EXAMPLE_MANHATTAN", "")
CLASH = os.environ.get("RPE_TEST_CLASH_PLUGIN", "")  # tests/plugins/clash.cpp: registers "euc", a name taken

# |dr| + |dc| from the centre of a 5x5 grid through the piecewise index of ratio 1.9:
# distances 0, 1, 2, 3, 4 -> ids 0, 1, 2, 2, 3 (g(3) = round(2.32), g(4) = round(2.58))
MANHATTAN_5X5 = [[3, 2, 2, 2, 3], [2, 2, 1, 2, 2], [2, 1, 0, 1, 2], [2, 2, 1, 2, 2], [3, 2, 2, 2, 3]]


def test_names_come_from_the_library():
    assert rt.families("irpe") == ["euclidean", "quantization", "cross", "product"]
    names = rt.families("", True)
    for n in ["euc", "quant", "euclidean_paper", "shaw", "t5", "t5_causal", "product3d", "swin", "beit", "swinv2",
              "decomposed", "sam", "alibi2d", "alibi"]:
        assert n in names
    assert torch.ops.rpe.family_name("euc") == "euclidean"
    assert torch.ops.rpe.family_mode("sam") == "contextual"
    assert torch.ops.rpe.family_mode("swin") == "bias"
    assert torch.ops.rpe.family_spec("product", 1.9, 3.8, 15.2) == "product:index=piecewise,alpha=1.9,beta=3.8,gamma=15.2"
    assert torch.ops.rpe.family_spec("swin", 7, 5, 0) == "swin:window_h=7,window_w=5"
    with pytest.raises(ValueError, match=r"\[rpe\.term_spec\] family = 'hexagonal'; expected one of euclidean \(euc\)"):
        torch.ops.rpe.family_name("hexagonal")
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] method = 'prod'; expected one of euclidean, euc, quantization"):
        rt.get_rpe_config(method="prod")
    assert rt.get_rpe_config(method="quant").rpe_k.method == rt.METHOD.QUANT


def test_spec_text_as_method():
    # product, clip index, beta 2: offset (dr, dc) -> (dr + 2) * 5 + (dc + 2), 25 buckets
    ids = rt.bucket_ids("product:index=clip,beta=2", 0.0, 0.0, 0.0, 0, 3, 3)
    assert ids.shape == (1, 9, 9)
    assert ids[0, 0, 8].item() == (-2 + 2) * 5 + (-2 + 2)
    assert ids[0, 8, 0].item() == (2 + 2) * 5 + (2 + 2)
    assert torch.ops.rpe.num_buckets("product:index=clip,beta=2", 0.0, 0.0, 0.0, 0) == 25


@pytest.mark.skipif(not PLUGIN, reason="the example plugin was not built (RPE_EXAMPLE_MANHATTAN unset)")
def test_user_mapping_from_a_plugin():
    torch.ops.load_library(PLUGIN)
    assert "manhattan" in rt.families("user")
    assert "taxicab" in rt.families("user", True)
    ids = rt.bucket_ids("manhattan", 1.9, 3.8, 15.2, 0, 5, 5)
    assert ids[0, 12].reshape(5, 5).tolist() == MANHATTAN_5X5
    assert torch.ops.rpe.num_buckets("manhattan", 1.9, 3.8, 15.2, 1) == 5  # beta_int + 1, + 1 skip bucket
    # a bias term on it: out[0, 0, i, j] = table[0, id(i, j)], and the table's gradient counts the pairs
    table = (torch.arange(4, dtype=torch.float32) * 10).reshape(1, 4).requires_grad_(True)
    out = rt.term(None, [table], "manhattan", "bias", "k", 1.9, 3.8, 15.2, 0, 5, 5)
    assert out.shape == (1, 1, 25, 25)
    assert torch.equal(out[0, 0, 12].reshape(5, 5), torch.tensor(MANHATTAN_5X5, dtype=torch.float32) * 10)
    out.sum().backward()
    full = rt.bucket_ids("manhattan", 1.9, 3.8, 15.2, 0, 5, 5)[0]
    assert table.grad[0].tolist() == [float((full == b).sum()) for b in range(4)]
    # the spec text sets any parameter: beta 5 -> 6 buckets
    assert torch.ops.rpe.num_buckets("taxicab:beta=5", 0.0, 0.0, 0.0, 0) == 6


@pytest.mark.skipif(not CLASH, reason="the clashing test plugin was not built (RPE_TEST_CLASH_PLUGIN unset)")
def test_plugin_with_a_taken_name_is_refused_not_fatal():
    # it used to call std::terminate from the plugin's static initialisation, killing Python
    with pytest.raises(ValueError, match=r"\[rpe\.torch\] plugin = '.*librpe_test_clash_plugin[^']*' cannot be loaded: "
                                         r"\[rpe\.registry\] name = 'euc'; already registered \(euclidean\)"):
        rt.load_plugin(CLASH)
    assert torch.ops.rpe.family_name("euc") == "euclidean"  # the built-in stays, the registry works
    assert "euc" not in rt.families("user", True)
