// Golden cases (tests/data/golden) read on the host by golden_cases.cpp (g++, nlohmann/json), so
// that no .cu file parses the JSON library. Plain vectors and values only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rpe_cuda_test {

/// One array of a golden case with its expected values and the README's tolerance rule.
struct expected_array {
    std::string file;
    std::vector<std::int64_t> shape;
    std::vector<double> values;
    double atol = 0, rtol = 0;  // float32 tolerances of the case
};

/// A golden `term` case: configuration, float32 inputs and float32 expected outputs.
struct term_case {
    std::string name;
    std::string method;  // euclidean, quantization, cross, product
    bool contextual = true;
    char target = 'k';
    double alpha = 0, beta = 0, gamma = 0;
    bool shared_head = true;
    int skip = 0, heads = 1, head_dim = 1, height = 0, width = 0, batch = 1;
    std::vector<std::vector<float>> tables;  // 1 or 2 (Cross)
    std::vector<std::int64_t> table_shape, x_shape, out_shape;
    std::vector<float> x, grad_out;
    expected_array out, grad_x;  // grad_x empty for bias
    std::vector<expected_array> grad_tables;
};

/// A golden `attention` case: inputs, expected output and gradients (float32).
struct attention_case {
    std::string name;
    std::string rpe_on;  // subset of "qkv"
    std::string method;
    bool contextual = true;
    double alpha = 0, beta = 0, gamma = 0;
    bool shared_head = true;
    int skip = 0, heads = 1, head_dim = 1, height = 0, width = 0, batch = 1, length = 0;
    std::vector<float> q, k, v, grad_out;
    std::vector<std::uint8_t> key_padding_mask;  // empty when none
    std::vector<std::vector<float>> tables[3];   // per slot q, k, v
    expected_array out, grad_q, grad_k, grad_v;
    std::vector<expected_array> grad_tables[3];  // per slot q, k, v
};

std::vector<term_case> load_term_cases(const std::string& golden_dir);
std::vector<attention_case> load_attention_cases(const std::string& golden_dir);

}  // namespace rpe_cuda_test
