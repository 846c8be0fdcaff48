/// @file core.hpp
/// @brief Umbrella header of rpe's backend-free core: policies (index functions, mappings, RoPE
/// forms), concepts, tensor_ref, errors, bucket ids and their cache, the term descriptor
/// (rpe::term_desc) and the attention front (rpe::attention_inputs, rpe::attention_options,
/// rpe::attention_gradients, rpe::attention_capabilities, the shared checks). No Eigen, no
/// CUDA, no <sstream> or <iostream>: both backends (<rpe/rpe.hpp> for the CPU, <rpe/cuda.cuh>)
/// build on it.
#pragma once

#include "attention_inputs.hpp"
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
#include "rope/mixed.hpp"
#include "rope/rotary.hpp"
#include "tensor.hpp"
#include "term_desc.hpp"
#include "term_fwd.hpp"
