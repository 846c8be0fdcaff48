/// @file rpe.hpp
/// @brief Umbrella header of rpe's CPU backend: everything a plain C++20 compiler builds.
///
/// rpe: relative position encoding for transformers, built around iRPE (Wu et al., ICCV 2021).
/// Compose an index function, a mapping and a mode into an rpe::term; bucket ids come from the
/// shared rpe::bucket_cache; rpe::attention_forward / _backward run the fused attention step, and
/// rpe::composed_attention_forward / _backward (<rpe/backend/cpu/composed_attention.hpp>, the
/// reference-shaped baseline, included last) the same step composed from single terms.
/// The file readers (.npy, safetensors) live in <rpe/io/npy.hpp> and <rpe/io/safetensors.hpp>
/// (they need nlohmann-json; CMake target rpe::io). Terms configured by name at run time
/// (rpe::make_term, rpe::term_spec) live in <rpe/make_term.hpp>, outside the umbrella for its build cost.
#pragma once

#include "any_term.hpp"
#include "attention.hpp"
#include "backend/tags.hpp"
#include "bucket_cache.hpp"
#include "caches.hpp"
#include "bucket_ids.hpp"
#include "bucket_key.hpp"
#include "build_bucket_ids.hpp"
#include "concepts.hpp"
#include "config.hpp"
#include "error.hpp"
#include "index/clip.hpp"
#include "index/piecewise.hpp"
#include "mapping/beit.hpp"
#include "mapping/cross.hpp"
#include "mapping/euclidean.hpp"
#include "mapping/product.hpp"
#include "mapping/product3d.hpp"
#include "mapping/quantization.hpp"
#include "mapping/shaw.hpp"
#include "mapping/swin.hpp"
#include "mapping/t5.hpp"
#include "mapping/within_grid.hpp"
#include "mode.hpp"
#include "rope/axial.hpp"
#include "rope/cat.hpp"
#include "rope/dinov3.hpp"
#include "rope/mixed.hpp"
#include "rope/mrope.hpp"
#include "rope/positions.hpp"
#include "rope/rotary.hpp"
#include "rope/vjepa2.hpp"
#include "tensor.hpp"
#include "term.hpp"
#include "vit/alibi_2d.hpp"
#include "vit/decomposed_rel_pos.hpp"
#include "vit/swin_bias.hpp"

// The reference-shaped baseline (single terms composed, as the reference's RPEAttention.forward),
// after the main API: tests and conformance compare the fused attention with it.
#include "backend/cpu/composed_attention.hpp"
