#!/usr/bin/python3
"""Golden data for rpe::rope::mrope (Qwen-VL multimodal RoPE) from huggingface/transformers' own code.

For each case the generator
- makes the position ids of a text + image (+ video) sequence with the model's own
  `get_rope_index` (Qwen2VLModel, Qwen2_5_VLModel or Qwen3VLModel, called on a stand-in `self`
  that has only the config fields it reads and the class's own get_vision_position_ids);
- builds the language model's rotary embedding class (Qwen2VLRotaryEmbedding,
  Qwen2_5_VLRotaryEmbedding, Qwen3VLTextRotaryEmbedding) from the model's own text config class
  with the case's rope_theta and mrope_section, and calls it on those position ids (its
  recomposition_frequencies: consecutive sections for Qwen2-VL / Qwen2.5-VL, interleaved for
  Qwen3-VL);
- rotates a random q with the module's apply_rotary_pos_emb (rotate-half) and takes the
  gradient of sum(y * grad_y) by torch autograd.
The vision encoder's 2D RoPE is one more case (`qwen2vl_vision_*`): the patches' (h, w) ids in the
2x2 merge-block order from transformers' `vision_utils.get_vision_position_ids`, then
Qwen2VLVisionRotaryEmbedding and apply_rotary_pos_emb_vision (rpe's rope::cat with layout half
and these positions).

Usage (by hand; transformers >= 5 and PyTorch needed only here; transformers kept out of the
venv, e.g. `pip install --no-deps --target /tmp/tfpkg transformers`):
  PYTHONPATH=/tmp/tfpkg /path/to/venv/bin/python tools/golden/gen_qwen_mrope.py [out_dir]
out_dir defaults to tests/data/golden_vit/rope.
"""
import functools
import json
import os
import sys
import types

import numpy as np
import torch
import transformers
from transformers.models.qwen2_vl import modeling_qwen2_vl as q2
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as q25
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
from transformers.models.qwen3_vl import modeling_qwen3_vl as q3
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.vision_utils import get_vision_position_ids

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

MODELS = {
    # model: (module, Model class, text config class, rotary class, interleaved)
    "qwen2_vl": (q2, q2.Qwen2VLModel, Qwen2VLTextConfig, q2.Qwen2VLRotaryEmbedding, False),
    "qwen2_5_vl": (q25, q25.Qwen2_5_VLModel, Qwen2_5_VLTextConfig, q25.Qwen2_5_VLRotaryEmbedding, False),
    "qwen3_vl": (q3, q3.Qwen3VLModel, Qwen3VLTextConfig, q3.Qwen3VLTextRotaryEmbedding, True),
}

# The sequences: (kind, n) text runs of n tokens; ("image", (t, h, w)) / ("video", (t, h, w)) patch
# grids (before the 2x2 spatial merge), as image_grid_thw / video_grid_thw.
CASES = [
    # name, model, head_dim, heads, theta, sections, sequence, extra get_rope_index arguments
    ("mrope_qwen2vl_d128", "qwen2_vl", 128, 1, 1000000.0, [16, 24, 24],
     [("text", 2), ("image", (1, 4, 6)), ("text", 1), ("video", (2, 4, 4)), ("text", 2)], {}),
    ("mrope_qwen25vl_d80_video", "qwen2_5_vl", 80, 1, 10000.0, [10, 15, 15],
     [("text", 3), ("video", (3, 4, 4)), ("text", 2)], {"second_per_grid_ts": torch.tensor([0.5])}),
    ("mrope_qwen3vl_d128_interleaved", "qwen3_vl", 128, 1, 5000000.0, [24, 20, 20],
     [("text", 2), ("image", (1, 6, 4)), ("text", 2), ("image", (1, 4, 4)), ("text", 1)], {}),
    ("mrope_qwen3vl_d64_interleaved", "qwen3_vl", 64, 2, 10000.0, [12, 10, 10],
     [("text", 3), ("image", (1, 4, 6)), ("text", 2)], {}),
]
SPATIAL_MERGE = 2
TOKENS_PER_SECOND = 25  # Qwen2.5-VL's vision_config.tokens_per_second default


def position_ids(model, sequence, extra):
    """(3, 1, L) position ids from the model class's own get_rope_index."""
    _, cls, _, _, _ = MODELS[model]
    types_, images, videos = [], [], []
    for kind, v in sequence:
        if kind == "text":
            types_ += [0] * v
        else:
            t, h, w = v
            n = t * h * w // (SPATIAL_MERGE * SPATIAL_MERGE)
            types_ += [1 if kind == "image" else 2] * n
            (images if kind == "image" else videos).append(list(v))
    vision = types.SimpleNamespace(spatial_merge_size=SPATIAL_MERGE, tokens_per_second=TOKENS_PER_SECOND)
    fake = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision))
    fake.get_vision_position_ids = functools.partial(cls.get_vision_position_ids, fake)
    input_ids = torch.zeros(1, len(types_), dtype=torch.long)
    mm = torch.tensor([types_], dtype=torch.int)
    pos, _ = cls.get_rope_index(fake, input_ids, mm,
                                image_grid_thw=torch.tensor(images) if images else None,
                                video_grid_thw=torch.tensor(videos) if videos else None, **extra)
    return pos


def vision_case(out_dir, name, d, h, grid_thw, seed):
    """Qwen2-VL's vision encoder RoPE: (h, w) per patch in merge-block order, rotate-half."""
    config = Qwen2VLVisionConfig(embed_dim=d * h, num_heads=h)
    pos = get_vision_position_ids(torch.tensor([grid_thw]), config.spatial_merge_size)  # (N, 2) (h, w)
    n = pos.shape[0]
    rotary = q2.Qwen2VLVisionRotaryEmbedding(config)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=gen, dtype=torch.float32)  # the source's (tokens, heads, D)
    cos, sin = rotary(x, pos)
    y, _ = q2.apply_rotary_pos_emb_vision(x, x, cos, sin)
    out = os.path.join(out_dir, name)
    os.makedirs(out, exist_ok=True)
    np.save(os.path.join(out, "x.npy"), x.permute(1, 0, 2)[None].contiguous().numpy())
    np.save(os.path.join(out, "y.npy"), y.permute(1, 0, 2)[None].contiguous().numpy())
    np.save(os.path.join(out, "positions.npy"), pos.numpy().astype(np.float32))
    meta = {"source": "transformers %s %s (vision_utils.get_vision_position_ids, Qwen2VLVisionRotaryEmbedding, "
                      "apply_rotary_pos_emb_vision)" % (transformers.__version__, q2.__name__),
            "form": "cat", "layout": "half", "batch": 1, "heads": h, "head_dim": d, "L": n, "skip": 0, "suffix": 0,
            "temperature": config.rope_parameters["rope_theta"], "grid_thw": list(grid_thw),
            "spatial_merge_size": config.spatial_merge_size,
            "files": {"x.npy": "input (B, H, L, D) (the source's (L, H, D) transposed)", "y.npy": "rotated (B, H, L, D)",
                      "positions.npy": "patch ids (L, 2) (h, w) in merge-block order, as float32"}}
    json.dump(meta, open(os.path.join(out, "meta.json"), "w"), indent=1)
    print("wrote", out, "L =", n)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "data", "golden_vit", "rope")
    vision_case(out_dir, "qwen2vl_vision_d80_4x6", 80, 1, (1, 4, 6), 2600)
    for i, (name, model, d, h, theta, sections, sequence, extra) in enumerate(CASES):
        module, _, config_cls, rotary_cls, interleaved = MODELS[model]
        pos = position_ids(model, sequence, extra)  # (3, 1, L)
        l = pos.shape[-1]
        config = config_cls(hidden_size=d * h, num_attention_heads=h, num_key_value_heads=h, head_dim=d,
                            rope_parameters={"rope_type": "default", "rope_theta": theta, "mrope_section": sections})
        rotary = rotary_cls(config)
        assert rotary.mrope_section == sections and config.head_dim == d, name
        gen = torch.Generator().manual_seed(2500 + i)
        x = torch.randn(1, h, l, d, generator=gen, dtype=torch.float32, requires_grad=True)
        grad_y = torch.randn(1, h, l, d, generator=gen, dtype=torch.float32)
        cos, sin = rotary(x, pos)  # (1, L, D)
        y, _ = module.apply_rotary_pos_emb(x, x, cos, sin)
        (grad_x,) = torch.autograd.grad((y * grad_y).sum(), x)
        out = os.path.join(out_dir, name)
        os.makedirs(out, exist_ok=True)
        np.save(os.path.join(out, "x.npy"), x.detach().numpy())
        np.save(os.path.join(out, "y.npy"), y.detach().numpy())
        np.save(os.path.join(out, "grad_y.npy"), grad_y.numpy())
        np.save(os.path.join(out, "grad_x.npy"), grad_x.numpy())
        np.save(os.path.join(out, "positions.npy"), pos[:, 0, :].T.contiguous().numpy().astype(np.float32))
        meta = {"source": "transformers %s %s (get_rope_index, %s, apply_rotary_pos_emb)"
                          % (transformers.__version__, module.__name__, rotary_cls.__name__),
                "form": "mrope", "layout": "half", "batch": 1, "heads": h, "head_dim": d, "L": l, "skip": 0,
                "suffix": 0, "theta": theta, "sections": sections, "interleaved": interleaved,
                "sequence": [[k, v] for k, v in sequence], "spatial_merge_size": SPATIAL_MERGE,
                "files": {"x.npy": "input (B, H, L, D)", "y.npy": "rotated (B, H, L, D)",
                          "positions.npy": "position ids (L, 3) (t, h, w) from get_rope_index, as float32",
                          "grad_y.npy": "upstream gradient (B, H, L, D)",
                          "grad_x.npy": "d sum(y * grad_y) / dx by torch autograd"}}
        if "second_per_grid_ts" in extra:
            meta["second_per_grid_ts"] = extra["second_per_grid_ts"].tolist()
            meta["tokens_per_second"] = TOKENS_PER_SECOND
        json.dump(meta, open(os.path.join(out, "meta.json"), "w"), indent=1)
        print("wrote", out, "L =", l, "positions", pos[:, 0, :].tolist())


if __name__ == "__main__":
    main()
