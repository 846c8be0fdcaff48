// Helpers of the CUDA tests: device buffers, seeded random data, storage-type conversion and the
// one comparison rule that every CUDA-vs-CPU check uses.
#pragma once

#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <span>
#include <string>
#include <vector>

#include <rpe/backend/cuda/error.cuh>
#include <rpe/backend/cuda/types.cuh>
#include <rpe/tensor.hpp>

namespace rpe_cuda_test {

/// Device copy of a host vector (RAII).
template <class T>
class device_vec {
public:
    explicit device_vec(std::size_t n) : n_(n) {
        RPE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), std::max<std::size_t>(n, 1) * sizeof(T)));
    }
    explicit device_vec(const std::vector<T>& h) : device_vec(h.size()) {
        RPE_CUDA_CHECK(cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    }
    device_vec(const device_vec&) = delete;
    device_vec& operator=(const device_vec&) = delete;
    ~device_vec() { (void)cudaFree(p_); }
    [[nodiscard]] T* get() const { return p_; }
    [[nodiscard]] std::vector<T> host() const {
        std::vector<T> h(n_);
        RPE_CUDA_CHECK(cudaDeviceSynchronize());  // tests only: wait for the stream's work
        RPE_CUDA_CHECK(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
        return h;
    }
    [[nodiscard]] rpe::tensor_ref<T> ref(const std::vector<std::int64_t>& shape) const {
        return rpe::tensor_ref<T>(p_, std::span<const std::int64_t>(shape));
    }
    [[nodiscard]] rpe::tensor_ref<const T> cref(const std::vector<std::int64_t>& shape) const { return ref(shape); }

private:
    T* p_ = nullptr;
    std::size_t n_ = 0;
};

/// A host tensor_ref with a run-time shape.
template <class T>
rpe::tensor_ref<T> view(T* data, const std::vector<std::int64_t>& shape) {
    return rpe::tensor_ref<T>(data, std::span<const std::int64_t>(shape));  // checks rank <= 4
}

inline std::int64_t count(const std::vector<std::int64_t>& shape) {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
}

/// N(0, sigma²) floats, seeded.
inline std::vector<float> random_floats(std::int64_t n, unsigned seed, float sigma = 1.f) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> dist(0.f, sigma);
    std::vector<float> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = dist(gen);
    return v;
}

/// Converts floats to storage type S (round to nearest even) and back.
template <class S>
std::vector<S> to_storage(const std::vector<float>& v) {
    std::vector<S> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = rpe::cuda::from_acc<S>(v[i]);
    return out;
}
template <class S>
std::vector<double> to_double(const std::vector<S>& v) {
    std::vector<double> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<double>(rpe::cuda::to_acc(v[i]));
    return out;
}
/// Rounds floats through S (what the GPU sees as inputs when it stores S).
template <class S>
std::vector<float> round_through(const std::vector<float>& v) {
    std::vector<float> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(rpe::cuda::to_acc(rpe::cuda::from_acc<S>(v[i])));
    return out;
}

/// (N, A) coordinates of a depth × height × width grid's tokens in a seeded random order: row i
/// holds grid token perm[i]'s (r, c), or (t, r, c) when depth > 1 (perm a std::shuffle of 0..N−1
/// by std::mt19937(seed)).
inline std::vector<std::int32_t> permuted_grid(int depth, int height, int width, unsigned seed) {
    const int n = depth * height * width;
    std::vector<int> perm(static_cast<std::size_t>(n));
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<std::int32_t> out;
    for (int i : perm) {
        if (depth > 1) out.push_back(i / (height * width));
        out.push_back((i / width) % height);
        out.push_back(i % width);
    }
    return out;
}

/// The comparison rule of every CUDA check: |actual − expected| ≤ atol + rtol·|expected| for
/// every element (a NaN fails). Reports the first failing element and the count.
inline void check_close(const std::string& what, const std::vector<double>& actual, const std::vector<double>& expected,
                        double atol, double rtol) {
    REQUIRE(actual.size() == expected.size());
    std::size_t bad = 0, first = 0;
    double worst = 0;
    for (std::size_t i = 0; i < actual.size(); ++i) {
        const double diff = std::fabs(actual[i] - expected[i]), bound = atol + rtol * std::fabs(expected[i]);
        if (!(diff <= bound)) {
            if (bad++ == 0) first = i;
        }
        if (diff == diff) worst = std::max(worst, diff / bound);
    }
    std::ostringstream os;
    if (bad)
        os << what << ": " << bad << " of " << actual.size() << " elements differ; first at " << first << ": " << actual[first]
           << " vs " << expected[first] << " (atol " << atol << ", rtol " << rtol << ")";
    INFO(os.str());
    CHECK(bad == 0);
    MESSAGE(what << ": worst |diff| / tolerance = " << worst);
}

/// The fused attention's comparison with the CPU's (docs/cuda.md, Tolerances): out, grad_q, grad_k
/// and grad_v (N = D + L) and every table gradient (N = B·H·L², in slot order q, k, v) each within
/// ε·rms(cpu) + ε·|cpu| elementwise, ε = c·u·√N with u S's unit roundoff and c = 16 for float and
/// double, 4 for fp16 and bf16 (their CPU reference is float on the unrounded inputs).
template <class S, class C>
void check_attention_results(std::int64_t b, std::int64_t h, std::int64_t l, std::int64_t d, const device_vec<S>& dout,
                             const device_vec<S>& dgq, const device_vec<S>& dgk, const device_vec<S>& dgv,
                             const std::vector<C>& cout, const std::vector<C>& cgq, const std::vector<C>& cgk,
                             const std::vector<C>& cgv, const std::vector<std::unique_ptr<device_vec<S>>>& dgtables,
                             const std::vector<std::vector<C>> (&cgtables)[3]) {
    const double u = rpe::cuda::unit_roundoff<S>();
    const bool low = std::is_same_v<S, __half> || std::is_same_v<S, __nv_bfloat16>;
    const auto check_vs = [&](const std::string& what, const std::vector<double>& gpu, const std::vector<C>& cpu, double len) {
        const double e = (low ? 4.0 : 16.0) * u * std::sqrt(len);
        const std::vector<double> ex(cpu.begin(), cpu.end());
        double ss = 0;
        for (double x : ex) ss += x * x;
        check_close(what, gpu, ex, e * std::sqrt(ss / static_cast<double>(std::max<std::size_t>(ex.size(), 1))), e);
    };
    const auto n = static_cast<double>(d + l);
    check_vs("out", to_double(dout.host()), cout, n);
    check_vs("grad_q", to_double(dgq.host()), cgq, n);
    check_vs("grad_k", to_double(dgk.host()), cgk, n);
    check_vs("grad_v", to_double(dgv.host()), cgv, n);
    std::size_t index = 0;
    for (int s = 0; s < 3; ++s)
        for (std::size_t t = 0; t < cgtables[s].size(); ++t)
            check_vs(std::string("grad table ") + "qkv"[s] + std::to_string(t), to_double(dgtables.at(index++)->host()),
                     cgtables[s][t], static_cast<double>(b * h * l * l));
    CHECK(index == dgtables.size());
}

}  // namespace rpe_cuda_test
