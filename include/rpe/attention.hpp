/// @file attention.hpp
/// @brief The fused attention step with iRPE on the CPU: rpe::cpu::attention_forward /
/// rpe::cpu::attention_backward (also reachable as rpe::attention_forward / _backward;
/// implementation in backend/cpu/attention.hpp). Inputs, options, gradients, capabilities and
/// their checks are the backend-free front in attention_inputs.hpp, shared with the CUDA
/// backend's rpe::cuda::attention_forward / _backward in <rpe/cuda.cuh>.
#pragma once

#include "attention_inputs.hpp"
#include "backend/cpu/attention.hpp"
