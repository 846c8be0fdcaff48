// rpe_cuda_bench [--quick | --paths]: CUDA benchmarks of the rpe CUDA backend, timed with CUDA events
// (median of the timed runs after warm-ups). One line per case:
//   BM_CudaContextualGather/<type>/B=../H=../L=.. ms=<median> GB/s=<effective> pct_hbm_peak=<%>
//   BM_CudaContextualKeyForward/<type>/... ms=... GB/s=...        (GEMM x·table + gather)
//   BM_CudaAttention/<type>/<rpe>/B=../H=../L=../D=.. ms=... ratio_vs_no_rpe=...
//     (<rpe>: none, k, qkv (iRPE-K/QKV), rope (RoPE-Axial), rope_k (RoPE-Axial + iRPE-K))
//   BM_CudaAttentionPath/<type>/<rpe>/B=../H=../L=../D=.. tensor_cores=<0|1> tc_ms=... simt_ms=... speedup=...
//     (the forward's tensor-core kernel against its SIMT kernel, <rpe>: none, k; --paths: these only)
// Effective bytes of the gather: the (B,H,L,L) output written, the (B,H,L,K) products and the
// (L,L) ids read once. The HBM peak is 2 × memory clock × bus width (device attributes).
// Without a CUDA device: prints "skipped: no CUDA device" and exits 77.
#include <rpe/cuda.cuh>
#include <rpe/rpe.hpp>
#include <rpe/make_term.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

using pw = rpe::index::piecewise;
using product = rpe::mapping::product<pw>;

template <class T>
struct buffer {
    T* p = nullptr;
    explicit buffer(std::size_t n) {
        RPE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), std::max<std::size_t>(n, 1) * sizeof(T)));
    }
    ~buffer() { (void)cudaFree(p); }
    buffer(const buffer&) = delete;
    buffer& operator=(const buffer&) = delete;
};

template <class T>
__global__ void fill_kernel(T* p, std::size_t n, unsigned seed) {
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
        unsigned x = static_cast<unsigned>(i) * 2654435761u ^ seed;
        x ^= x >> 13;
        x *= 0x5bd1e995u;
        x ^= x >> 15;
        p[i] = rpe::cuda::from_acc<T>((static_cast<float>(x & 0xffff) / 65536.0f - 0.5f));
    }
}
template <class T>
void fill(T* p, std::size_t n, unsigned seed) {
    fill_kernel<<<1024, 256>>>(p, n, seed);
    RPE_CUDA_CHECK(cudaGetLastError());
}

// Median milliseconds of `runs` timed calls of f after `warm` untimed ones.
template <class F>
double time_ms(F&& f, int warm, int runs) {
    for (int i = 0; i < warm; ++i) f();
    cudaEvent_t a, b;
    RPE_CUDA_CHECK(cudaEventCreate(&a));
    RPE_CUDA_CHECK(cudaEventCreate(&b));
    std::vector<double> ms;
    for (int i = 0; i < runs; ++i) {
        RPE_CUDA_CHECK(cudaEventRecord(a));
        f();
        RPE_CUDA_CHECK(cudaEventRecord(b));
        RPE_CUDA_CHECK(cudaEventSynchronize(b));
        float t = 0;
        RPE_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
        ms.push_back(t);
    }
    RPE_CUDA_CHECK(cudaEventDestroy(a));
    RPE_CUDA_CHECK(cudaEventDestroy(b));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

template <class S>
const char* type_name() {
    if constexpr (std::is_same_v<S, float>)
        return "f32";
    else if constexpr (std::is_same_v<S, __half>)
        return "f16";
    else if constexpr (std::is_same_v<S, __nv_bfloat16>)
        return "bf16";
    else
        return "f64";
}

double hbm_peak_gbs() {
    int dev = 0, clock_khz = 0, bus_bits = 0;
    RPE_CUDA_CHECK(cudaGetDevice(&dev));
    RPE_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev));
    RPE_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev));
    return 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
}

template <class S>
void bench_gather(int b, int h, int grid, int warm, int runs, double peak) {
    using A = rpe::cuda::acc_t<S>;
    const rpe::term<product, rpe::mode::contextual, rpe::target::key, S, rpe::backend::cuda> t(
        product{pw::from_ratio(1.9)}, {.num_heads = h, .head_dim = 64, .skip = 1});
    const auto ids = t.bucket_ids(grid, grid);
    const std::int64_t l = ids->length(), k = t.num_buckets(), d = 64, planes = std::int64_t{b} * h;
    buffer<S> x(planes * l * d), table(d * k), out(planes * l * l);
    buffer<A> tk(planes * l * k);
    fill(x.p, planes * l * d, 1);
    fill(table.p, d * k, 2);
    fill(tk.p, planes * l * k, 3);
    const auto dev = rpe::cuda::device_bucket_cache::global().get(*ids);
    const double ms_gather = time_ms(
        [&] {
            dev->visit(0, false, [&](const auto& id) {
                rpe::detail::gpu::gather(static_cast<const A*>(tk.p), l * k, false, h, 1, k, false, id, l, planes, false, out.p,
                                         nullptr);
            });
        },
        warm, runs);
    const double bytes = static_cast<double>(planes * l * l * sizeof(S) + planes * l * k * sizeof(A) + dev->bytes());
    std::printf("BM_CudaContextualGather/%s/B=%d/H=%d/L=%lld ms=%.4f GB/s=%.1f pct_hbm_peak=%.1f\n", type_name<S>(), b, h,
                static_cast<long long>(l), ms_gather, bytes / ms_gather / 1e6, 100.0 * bytes / ms_gather / 1e6 / peak);
    const double ms_fwd = time_ms(
        [&] {
            t.forward(*ids, rpe::tensor_ref<const S>(table.p, {1, d, k}), rpe::tensor_ref<const S>(x.p, {b, h, l, d}),
                      rpe::tensor_ref<S>(out.p, {b, h, l, l}), rpe::write::overwrite);
        },
        warm, runs);
    const double fbytes = bytes + static_cast<double>(planes * l * d * sizeof(S) + planes * l * k * sizeof(A));
    std::printf("BM_CudaContextualKeyForward/%s/B=%d/H=%d/L=%lld ms=%.4f GB/s=%.1f pct_hbm_peak=%.1f\n", type_name<S>(), b, h,
                static_cast<long long>(l), ms_fwd, fbytes / ms_fwd / 1e6, 100.0 * fbytes / ms_fwd / 1e6 / peak);
    std::fflush(stdout);
}

// The attention benchmarks' q, k, v and out (B, H, L, D), L = 1 + grid² (a class token and a
// grid × grid image), q, k, v filled with fixed pseudo-random values (seeds 4, 5, 6), and the
// timing of one forward on them.
template <class S>
struct attention_buffers {
    int b, h, grid, d;
    std::int64_t l, n;
    buffer<S> q, k, v, out;

    attention_buffers(int b_, int h_, int grid_, int d_)
        : b(b_),
          h(h_),
          grid(grid_),
          d(d_),
          l(1 + std::int64_t{grid_} * grid_),
          n(std::int64_t{b_} * h_ * l * d_),
          q(n),
          k(n),
          v(n),
          out(n) {
        fill(q.p, n, 4);
        fill(k.p, n, 5);
        fill(v.p, n, 6);
    }

    // Inputs of q, k, v on the grid: no term, no RoPE (the caller adds them).
    rpe::cuda::attention_inputs<S> inputs() const {
        const auto ref = [&](const S* p) { return rpe::tensor_ref<const S>(p, {b, h, l, d}); };
        rpe::cuda::attention_inputs<S> in;
        in.q = ref(q.p);
        in.k = ref(k.p);
        in.v = ref(v.p);
        in.height = in.width = grid;
        return in;
    }

    // Median milliseconds of the forward of `in` into out with `opt` (time_ms).
    double time_forward(const rpe::cuda::attention_inputs<S>& in, const rpe::attention_options& opt, int warm, int runs) {
        return time_ms([&] { rpe::cuda::attention_forward(in, rpe::tensor_ref<S>(out.p, {b, h, l, d}), {}, opt); }, warm, runs);
    }
};

template <class S>
void bench_attention(int b, int h, int grid, int d, int warm, int runs) {
    attention_buffers<S> x(b, h, grid, d);
    double base = 0;
    for (const char* on : {"none", "k", "qkv", "rope", "rope_k"}) {  // rope: RoPE-Axial (θ = 100) on q and k
        rpe::cuda::attention_inputs<S> in = x.inputs();
        if (std::strncmp(on, "rope", 4) == 0) in.rope = {.form = rpe::rope::axial{.theta = 100.0f}, .skip = 1};
        std::unique_ptr<rpe::any_term<float>> terms[3];
        std::vector<std::unique_ptr<buffer<S>>> tables;
        rpe::cuda::attention_term<S>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        const char letters[3] = {'q', 'k', 'v'};
        for (int s = 0; s < 3; ++s) {
            if (std::strchr(std::strncmp(on, "rope", 4) == 0 ? on + 4 : on, letters[s]) == nullptr) continue;
            rpe::term_spec spec;  // reference default: product, ratio 1.9, contextual, shared, class token
            spec.target = rpe::parse_target(std::string(1, letters[s]));
            spec.num_heads = h;
            spec.head_dim = d;
            terms[s] = rpe::make_term<float>(spec);
            slots[s]->term = terms[s].get();
            const auto shape_t = terms[s]->table_shape();
            const std::int64_t size = shape_t[0] * shape_t[1] * shape_t[2];
            tables.push_back(std::make_unique<buffer<S>>(size));
            fill(tables.back()->p, size, 7 + s);
            slots[s]->tables.push_back(rpe::tensor_ref<const S>(tables.back()->p, {shape_t[0], shape_t[1], shape_t[2]}));
        }
        const double ms = x.time_forward(in, {}, warm, runs);
        if (base == 0) base = ms;
        std::printf("BM_CudaAttention/%s/%s/B=%d/H=%d/L=%lld/D=%d ms=%.4f ratio_vs_no_rpe=%.3f\n", type_name<S>(), on, b, h,
                    static_cast<long long>(x.l), d, ms, ms / base);
        std::fflush(stdout);
    }
}

// The forward's two kernels on the same inputs: the tensor-core kernel (fp16/bf16, D a multiple
// of 16, no value term; attention_options::tensor_cores = true) and the SIMT kernel (false), without
// RPE and with iRPE-K (product, ratio 1.9, contextual, shared, class token).
template <class S>
void bench_attention_paths(int b, int h, int grid, int d, int warm, int runs) {
    attention_buffers<S> x(b, h, grid, d);
    rpe::term_spec spec;
    spec.target = rpe::target::key;
    spec.num_heads = h;
    spec.head_dim = d;
    const auto term = rpe::make_term<float>(spec);
    const auto shape_t = term->table_shape();
    buffer<S> table(shape_t[0] * shape_t[1] * shape_t[2]);
    fill(table.p, shape_t[0] * shape_t[1] * shape_t[2], 8);
    for (const char* on : {"none", "k"}) {
        rpe::cuda::attention_inputs<S> in = x.inputs();
        if (on[0] == 'k')
            in.rpe_k = {.term = term.get(), .tables = {rpe::tensor_ref<const S>(table.p, {shape_t[0], shape_t[1], shape_t[2]})}};
        double ms[2] = {0, 0};
        for (int simt = 0; simt < 2; ++simt) {
            ms[simt] = x.time_forward(in, {.tensor_cores = simt == 0}, warm, runs);
        }
        std::printf("BM_CudaAttentionPath/%s/%s/B=%d/H=%d/L=%lld/D=%d tensor_cores=%d tc_ms=%.4f simt_ms=%.4f speedup=%.2f\n",
                    type_name<S>(), on, b, h, static_cast<long long>(x.l), d,
                    static_cast<int>(rpe::cuda::attention_forward_uses_tensor_cores(in, {.tensor_cores = true})), ms[0], ms[1],
                    ms[1] / ms[0]);
        std::fflush(stdout);
    }
}

}  // namespace

int main(int argc, char** argv) {
    const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
    const bool paths = argc > 1 && std::strcmp(argv[1], "--paths") == 0;  // the tensor-core vs SIMT cases only
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        std::printf("skipped: no CUDA device (%s)\n", err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        return 77;
    }
    try {
        cudaDeviceProp prop{};
        RPE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
        const double peak = hbm_peak_gbs();
        std::printf("device: %s, sm_%d%d, HBM peak %.0f GB/s (2 x memory clock x bus width)\n", prop.name, prop.major, prop.minor,
                    peak);
        const int warm = quick ? 1 : 5, runs = quick ? 2 : 20;
        if (quick) {
            bench_gather<float>(2, 2, 14, warm, runs, peak);
            bench_attention<float>(2, 2, 14, 64, warm, runs);
            bench_attention_paths<__nv_bfloat16>(2, 2, 14, 64, warm, runs);
            return 0;
        }
        bench_attention_paths<__nv_bfloat16>(8, 6, 14, 64, warm, runs);
        bench_attention_paths<__nv_bfloat16>(4, 6, 28, 64, warm, runs);
        bench_attention_paths<__half>(8, 6, 14, 64, warm, runs);
        if (paths) return 0;
        for (int grid : {14, 28}) {
            bench_gather<float>(32, 6, grid, warm, runs, peak);
            bench_gather<__nv_bfloat16>(32, 6, grid, warm, runs, peak);
        }
        bench_attention<float>(8, 6, 14, 64, warm, runs);
        bench_attention<__nv_bfloat16>(8, 6, 14, 64, warm, runs);
        bench_attention<float>(4, 6, 28, 64, warm, runs);
    } catch (const std::exception& e) {
        std::printf("error: %s\n", e.what());
        return 1;
    }
    return 0;
}
