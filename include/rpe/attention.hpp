/// @file attention.hpp
/// @brief The fused attention step with iRPE on the CPU: rpe::attention_forward /
/// rpe::attention_backward and rpe::attention_options (implementation in
/// backend/cpu/attention.hpp; inputs and their checks in attention_inputs.hpp, shared with the
/// CUDA backend's rpe::cuda::attention_forward / _backward in <rpe/cuda.cuh>).
#pragma once

#include "attention_inputs.hpp"
#include "backend/cpu/attention.hpp"
