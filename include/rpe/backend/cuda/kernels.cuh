/// @file backend/cuda/kernels.cuh
/// @brief CUDA kernels of the RPE terms on raw row-major device buffers (not API: use
/// rpe::term<..., backend::cuda>). Same shapes and notation as backend/cpu/kernels.hpp.
///
/// `Ht` table heads (1 when shared), `h' = Ht == 1 ? 0 : h`. Storage type S (float, double,
/// __half, __nv_bfloat16), accumulation type A = acc_t<S> (double for double, else float): every
/// product and sum runs in A, and each output element is rounded to S once.
/// Every launch goes to the caller's stream; nothing here synchronises.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../detail/term_checks.hpp"
#include "error.cuh"
#include "types.cuh"

namespace rpe::detail::gpu {

using ::rpe::cuda::acc_t;
using ::rpe::cuda::from_acc;
using ::rpe::cuda::to_acc;

/// @brief Problem sizes shared by the kernels: the front's term_dims, as on the CPU.
using dims = term_dims;

/// @brief Device memory from the stream-ordered allocator, freed (stream-ordered) at scope exit.
template <class T>
class device_buffer {
public:
    device_buffer(std::int64_t count, cudaStream_t stream) : stream_(stream) {
        if (count > 0)
            RPE_CUDA_CHECK(
                cudaMallocAsync(reinterpret_cast<void**>(&data_), static_cast<std::size_t>(count) * sizeof(T), stream));
    }
    device_buffer(const device_buffer&) = delete;
    device_buffer& operator=(const device_buffer&) = delete;
    ~device_buffer() {
        if (data_) (void)cudaFreeAsync(data_, stream_);
    }
    [[nodiscard]] T* get() const { return data_; }

private:
    T* data_ = nullptr;
    cudaStream_t stream_;
};

/// @brief Uploads `count` values of host memory `src` into a new stream-ordered device buffer
/// (pageable source: staged before cudaMemcpyAsync returns, so `src` may go away after the call).
/// @throws rpe::cuda_error when the allocation or copy fails.
template <class T>
std::unique_ptr<device_buffer<T>> upload(const T* src, std::int64_t count, cudaStream_t stream) {
    auto buf = std::make_unique<device_buffer<T>>(count, stream);
    if (count > 0)
        RPE_CUDA_CHECK(
            cudaMemcpyAsync(buf->get(), src, static_cast<std::size_t>(count) * sizeof(T), cudaMemcpyHostToDevice, stream));
    return buf;
}

/// @brief Copies view `p` (int32, any shape) to `host` when it is contiguous, non-empty device or managed
/// memory, and returns the view of that copy (the copy waits for the caller's stream sync); else
/// returns `p` (host memory is read in place; what is not contiguous is refused by the checks
/// before any read). The same test as host_rope_positions: a pointer the runtime does not know
/// (or no device) is host memory.
inline tensor_ref<const std::int32_t> host_view(const tensor_ref<const std::int32_t>& p, std::vector<std::int32_t>& host,
                                                cudaStream_t stream, bool& copied) {
    if (p.data == nullptr || p.rank == 0 || !p.contiguous() || p.size() <= 0) return p;
    cudaPointerAttributes at{};
    if (cudaPointerGetAttributes(&at, p.data) != cudaSuccess) {
        (void)cudaGetLastError();  // no device, or not a CUDA pointer: host memory
        return p;
    }
    if (at.type != cudaMemoryTypeDevice && at.type != cudaMemoryTypeManaged) return p;
    host.resize(static_cast<std::size_t>(p.size()));
    RPE_CUDA_CHECK(cudaMemcpyAsync(host.data(), p.data, host.size() * sizeof(std::int32_t), cudaMemcpyDefault, stream));
    copied = true;
    tensor_ref<const std::int32_t> out = p;
    out.data = host.data();
    return out;
}

/// @brief Blocks for a grid-stride loop over `total` items with `threads` per block.
inline unsigned grid_for(std::int64_t total, int threads) {
    const std::int64_t blocks = (total + threads - 1) / threads;
    return static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, 65535 * 16));
}

/// @brief Throws rpe::cuda_error when the last launch failed (bad configuration); does not wait.
inline void check_launch(const char* what) { detail::cuda_check(cudaGetLastError(), what, __FILE__, __LINE__); }

// ---------------------------------------------------------------------------------------------
// Gather: out[p, i, j] (+)= t[off(p) + row(i, j)·row_stride + ids(i, j)]
//   ids: a device_id_view (ids computed from the per-offset ids, never an (L, L) buffer);
//   row(i, j) = i (key target), j (query target, ids transposed); row_stride = 0 for bias.
//   off(p) = p·plane_stride (per-plane T), or h'(p % heads)·plane_stride (bias table).
// ---------------------------------------------------------------------------------------------
// One warp per output row r = p·L + i (8 rows per block), lanes over j: coalesced writes, one
// division per row.
template <class S, class T, class Ids>
__global__ void gather_kernel(const T* __restrict__ t, std::int64_t plane_stride, bool by_head, std::int64_t heads,
                              std::int64_t table_heads, std::int64_t row_stride, bool transposed, Ids ids, std::int64_t n,
                              std::int64_t planes, bool accumulate, S* __restrict__ out) {
    const std::int64_t rows = planes * n;
    for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.y) + threadIdx.y; r < rows;
         r += static_cast<std::int64_t>(gridDim.x) * blockDim.y) {
        const std::int64_t p = r / n, i = r % n;
        const std::int64_t off = by_head ? (table_heads == 1 ? 0 : p % heads) * plane_stride : p * plane_stride;
        const T* tp = t + off + (transposed ? 0 : i * row_stride);
        S* o = out + r * n;
        for (std::int64_t j = threadIdx.x; j < n; j += 32) {
            const auto v = to_acc(tp[(transposed ? j * row_stride : 0) + ids(i, j)]);
            o[j] = accumulate ? from_acc<S>(to_acc(o[j]) + v) : from_acc<S>(v);
        }
    }
}

template <class S, class T, class Ids>
void gather(const T* t, std::int64_t plane_stride, bool by_head, std::int64_t heads, std::int64_t table_heads,
            std::int64_t row_stride, bool transposed, const Ids& ids, std::int64_t n, std::int64_t planes, bool accumulate,
            S* out, cudaStream_t stream) {
    const dim3 block(32, 8);
    gather_kernel<<<grid_for(planes * n, 8), block, 0, stream>>>(t, plane_stride, by_head, heads, table_heads, row_stride,
                                                                 transposed, ids, n, planes, accumulate, out);
    check_launch("gather_kernel");
}

// ---------------------------------------------------------------------------------------------
// Row scatter: out[r, k] = Σ_{j: ids(r % n, j) = k} g[r, j] for rows r of length n (overwrites).
// One block per row; a shared-memory histogram when K fits, else atomics on the output row.
// ---------------------------------------------------------------------------------------------
inline constexpr std::int64_t scatter_shared_bytes = 32 * 1024;

template <class S, class A, class Ids>
__global__ void scatter_rows_kernel(const S* __restrict__ g, Ids ids, std::int64_t n, std::int64_t k, std::int64_t rows,
                                    bool use_shared, A* __restrict__ out) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* hist = reinterpret_cast<A*>(smem_raw);
    for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const S* gr = g + r * n;
        const std::int64_t i = r % n;
        A* dst = use_shared ? hist : out + r * k;
        for (std::int64_t c = threadIdx.x; c < k; c += blockDim.x) dst[c] = A(0);
        __syncthreads();
        for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) atomicAdd(dst + ids(i, j), to_acc(gr[j]));
        __syncthreads();
        if (use_shared)
            for (std::int64_t c = threadIdx.x; c < k; c += blockDim.x) out[r * k + c] = hist[c];
        __syncthreads();
    }
}

/// @brief out (rows, K) = per-row bucket sums of g (rows, L); row r reads ids row r % L.
template <class S, class A, class Ids>
void scatter_rows(const S* g, const Ids& ids, std::int64_t n, std::int64_t k, std::int64_t rows, A* out, cudaStream_t stream) {
    const bool use_shared = k * static_cast<std::int64_t>(sizeof(A)) <= scatter_shared_bytes;
    const int threads = n >= 256 ? 256 : (n >= 128 ? 128 : 64);
    const auto blocks = static_cast<unsigned>(std::min<std::int64_t>(std::max<std::int64_t>(rows, 1), 1 << 20));
    scatter_rows_kernel<<<blocks, threads, use_shared ? static_cast<std::size_t>(k) * sizeof(A) : 0, stream>>>(g, ids, n, k, rows,
                                                                                                               use_shared, out);
    check_launch("scatter_rows_kernel");
}

// ---------------------------------------------------------------------------------------------
// Column scatter (query target): out[p, j, k] = Σ_{i: ids_t(i, j) = k} g[p, i, j], ids_t(i, j) = id(j, i)
// (a transposed device_id_view).
// One thread per (p, j), a serial loop over i: coalesced reads, no atomics, deterministic.
// ---------------------------------------------------------------------------------------------
template <class S, class A, class Ids>
__global__ void scatter_cols_kernel(const S* __restrict__ g, Ids ids_t, std::int64_t n, std::int64_t k, std::int64_t planes,
                                    A* __restrict__ out) {
    const std::int64_t total = planes * n;
    for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
        const std::int64_t p = e / n, j = e % n;
        A* row = out + e * k;
        for (std::int64_t c = 0; c < k; ++c) row[c] = A(0);
        const S* gp = g + p * n * n;
        for (std::int64_t i = 0; i < n; ++i) row[ids_t(i, j)] += to_acc(gp[i * n + j]);
    }
}

template <class S, class A, class Ids>
void scatter_cols(const S* g, const Ids& ids_t, std::int64_t n, std::int64_t k, std::int64_t planes, A* out,
                  cudaStream_t stream) {
    constexpr int threads = 128;
    scatter_cols_kernel<<<grid_for(planes * n, threads), threads, 0, stream>>>(g, ids_t, n, k, planes, out);
    check_launch("scatter_cols_kernel");
}

// ---------------------------------------------------------------------------------------------
// Batched GEMM: per plane p, C[p] (M, N) (+)= alpha · op(A[p]) (M, Kd) · op(B[b(p)]) (Kd, N).
//   A stored (M, Kd) row-major, or (Kd, M) when TA; B stored (Kd, N), or (N, Kd) when TB.
//   b(p) = p (per-plane B) or h'(p % heads) (a table).
// Through cuBLAS (cublasGemmStridedBatchedEx, compute in A: fp32 for float/fp16/bf16 storage,
// tensor cores for fp16/bf16; fp64 for double) when A and B share a storage type and the sizes
// fit cuBLAS's int arguments; otherwise 16×16 tiles in shared memory, one output element per
// thread, accumulation in A.
// ---------------------------------------------------------------------------------------------
struct gemm_shape {
    std::int64_t m = 0, n = 0, kd = 0, planes = 1;
    std::int64_t a_plane = 0, b_plane = 0, c_plane = 0;  // element strides between planes
    bool b_by_head = false;
    std::int64_t heads = 1, table_heads = 1;
};

inline constexpr int gemm_tile = 16;

template <bool TA, bool TB, class Acc, class TAe, class TBe, class TC>
__global__ void gemm_kernel(gemm_shape s, const TAe* __restrict__ a, const TBe* __restrict__ b, TC* __restrict__ c,
                            bool accumulate, Acc alpha) {
    __shared__ Acc as[gemm_tile][gemm_tile + 1];
    __shared__ Acc bs[gemm_tile][gemm_tile + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const std::int64_t row = blockIdx.y * static_cast<std::int64_t>(gemm_tile) + ty;
    const std::int64_t col = blockIdx.x * static_cast<std::int64_t>(gemm_tile) + tx;
    for (std::int64_t p = blockIdx.z; p < s.planes; p += gridDim.z) {
        const TAe* ap = a + p * s.a_plane;
        const TBe* bp = b + (s.b_by_head ? (s.table_heads == 1 ? 0 : p % s.heads) : p) * s.b_plane;
        Acc sum = 0;
        for (std::int64_t k0 = 0; k0 < s.kd; k0 += gemm_tile) {
            const std::int64_t ka = k0 + tx, kb = k0 + ty;
            Acc va = 0, vb = 0;
            if (row < s.m && ka < s.kd) va = to_acc(TA ? ap[ka * s.m + row] : ap[row * s.kd + ka]);
            if (col < s.n && kb < s.kd) vb = to_acc(TB ? bp[col * s.kd + kb] : bp[kb * s.n + col]);
            as[ty][tx] = static_cast<Acc>(va);
            bs[ty][tx] = static_cast<Acc>(vb);
            __syncthreads();
#pragma unroll
            for (int q = 0; q < gemm_tile; ++q) sum += as[ty][q] * bs[q][tx];
            __syncthreads();
        }
        if (row < s.m && col < s.n) {
            TC* dst = c + p * s.c_plane + row * s.n + col;
            const Acc v = alpha * sum;
            *dst = accumulate ? from_acc<TC>(static_cast<Acc>(to_acc(*dst)) + v) : from_acc<TC>(v);
        }
    }
}

/// @brief Throws rpe::runtime_error `[rpe.cuda] <what> failed: CUBLAS_STATUS_...` on a cuBLAS failure.
inline void cublas_check(cublasStatus_t status, const char* what) {
    if (status != CUBLAS_STATUS_SUCCESS)
        throw runtime_error(message("cuda", what, " failed: ", cublasGetStatusName(status), ": ", cublasGetStatusString(status)));
}

/// @brief The calling thread's cuBLAS handle for the current device, bound to `stream`. One
/// handle per (host thread, device), created on first use and destroyed when the thread ends.
inline cublasHandle_t cublas_handle(cudaStream_t stream) {
    struct handles {
        std::vector<std::pair<int, cublasHandle_t>> by_device;
        ~handles() {
            for (auto& [dev, h] : by_device) (void)cublasDestroy(h);
        }
    };
    thread_local handles cache;
    int dev = 0;
    RPE_CUDA_CHECK(cudaGetDevice(&dev));
    cublasHandle_t handle = nullptr;
    for (const auto& [d, h] : cache.by_device)
        if (d == dev) handle = h;
    if (!handle) {
        cublas_check(cublasCreate(&handle), "cublasCreate");
        cache.by_device.emplace_back(dev, handle);
    }
    cublas_check(cublasSetStream(handle, stream), "cublasSetStream");
    return handle;
}

/// @brief cuBLAS's data type of a storage type (CUDA_R_32F, ...).
template <class T>
constexpr cudaDataType_t cublas_type() {
    if constexpr (std::is_same_v<T, double>)
        return CUDA_R_64F;
    else if constexpr (std::is_same_v<T, __half>)
        return CUDA_R_16F;
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return CUDA_R_16BF;
    else
        return CUDA_R_32F;
}

/// @brief True when cublasGemmStridedBatchedEx takes (A, B, C) of these types with compute type
/// Acc: A and B of one type; fp32 compute for float, fp16 and bf16 (C in the same type or float);
/// fp64 for double.
template <class TAe, class TBe, class TC, class Acc>
inline constexpr bool cublas_gemm_types =
    std::is_same_v<TAe, TBe> && ((std::is_same_v<Acc, double> && std::is_same_v<TAe, double> && std::is_same_v<TC, double>) ||
                                 (std::is_same_v<Acc, float> && std::is_same_v<TAe, float> && std::is_same_v<TC, float>) ||
                                 (std::is_same_v<Acc, float> &&
                                  (std::is_same_v<TAe, __half> ||
                                   std::is_same_v<TAe, __nv_bfloat16>)&&(std::is_same_v<TC, TAe> || std::is_same_v<TC, float>)));

// One strided-batched call: row-major C (M, N) = op(A)·op(B) is column-major Cᵀ (N, M) =
// op(B)ᵀ·op(A)ᵀ, so cuBLAS gets B as its first operand and A as its second.
template <bool TA, bool TB, class Acc, class TAe, class TBe, class TC>
void gemm_cublas(const gemm_shape& s, const TAe* a, const TBe* b, TC* c, bool accumulate, Acc alpha, std::int64_t batches,
                 long long stride_b, cudaStream_t stream) {
    const Acc beta = accumulate ? Acc(1) : Acc(0);
    const int m = static_cast<int>(s.n), n = static_cast<int>(s.m), k = static_cast<int>(s.kd);
    const int ldb_first = static_cast<int>(TB ? s.kd : s.n), lda_second = static_cast<int>(TA ? s.m : s.kd);
    cublas_check(
        cublasGemmStridedBatchedEx(cublas_handle(stream), TB ? CUBLAS_OP_T : CUBLAS_OP_N, TA ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k,
                                   &alpha, b, cublas_type<TBe>(), ldb_first, stride_b, a, cublas_type<TAe>(), lda_second,
                                   static_cast<long long>(s.a_plane), &beta, c, cublas_type<TC>(), m,
                                   static_cast<long long>(s.c_plane), static_cast<int>(batches),
                                   std::is_same_v<Acc, double> ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmStridedBatchedEx");
}

template <bool TA, bool TB, class Acc, class TAe, class TBe, class TC>
void gemm(const gemm_shape& s, const TAe* a, const TBe* b, TC* c, bool accumulate, Acc alpha, cudaStream_t stream) {
    if (s.m == 0 || s.n == 0 || s.planes == 0) return;
    if constexpr (cublas_gemm_types<TAe, TBe, TC, Acc>) {
        constexpr std::int64_t int_max = std::numeric_limits<int>::max();
        const bool per_head = s.b_by_head && s.table_heads != 1;
        if (s.m <= int_max && s.n <= int_max && s.kd <= int_max && s.planes <= int_max &&
            (!per_head || s.planes % s.heads == 0)) {
            if (!s.b_by_head) {  // one B per plane
                gemm_cublas<TA, TB>(s, a, b, c, accumulate, alpha, s.planes, static_cast<long long>(s.b_plane), stream);
            } else if (!per_head) {  // one shared table: stride 0
                gemm_cublas<TA, TB>(s, a, b, c, accumulate, alpha, s.planes, 0LL, stream);
            } else {  // a table per head: planes b·H + h, one call per batch element over its H heads
                for (std::int64_t p0 = 0; p0 < s.planes; p0 += s.heads)
                    gemm_cublas<TA, TB>(s, a + p0 * s.a_plane, b, c + p0 * s.c_plane, accumulate, alpha, s.heads,
                                        static_cast<long long>(s.b_plane), stream);
            }
            return;
        }
    }
    const dim3 block(gemm_tile, gemm_tile);
    const dim3 grid(static_cast<unsigned>((s.n + gemm_tile - 1) / gemm_tile),
                    static_cast<unsigned>((s.m + gemm_tile - 1) / gemm_tile),
                    static_cast<unsigned>(std::min<std::int64_t>(s.planes, 65535)));
    gemm_kernel<TA, TB, Acc><<<grid, block, 0, stream>>>(s, a, b, c, accumulate, alpha);
    check_launch("gemm_kernel");
}

// ---------------------------------------------------------------------------------------------
// Reduction of per-plane partials into a table gradient, in a fixed order (deterministic):
//   out[h', e] (+)= Σ_{p: h'(p) = h'} Σ_{r < rows} part[(p·rows + r)·E + e]
// Block (32, 8): x over e, y over (p, r); a fixed-shape tree over y.
// ---------------------------------------------------------------------------------------------
template <class S, class A>
__global__ void reduce_partials_kernel(const A* __restrict__ part, std::int64_t planes, std::int64_t heads,
                                       std::int64_t table_heads, std::int64_t rows, std::int64_t size, bool accumulate,
                                       S* __restrict__ out) {
    __shared__ A acc[8][33];
    const std::int64_t e = blockIdx.x * 32 + threadIdx.x;
    const std::int64_t th = blockIdx.y;
    const std::int64_t count = table_heads == 1 ? planes : planes / heads;  // planes feeding this table head
    A sum = 0;
    if (e < size)
        for (std::int64_t q = threadIdx.y; q < count * rows; q += 8) {
            const std::int64_t m = q / rows, r = q % rows;
            const std::int64_t p = table_heads == 1 ? m : m * heads + th;
            sum += part[(p * rows + r) * size + e];
        }
    acc[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && e < size) {
        A total = 0;
        for (int y = 0; y < 8; ++y) total += acc[y][threadIdx.x];
        S* dst = out + th * size + e;
        *dst = accumulate ? from_acc<S>(to_acc(*dst) + total) : from_acc<S>(total);
    }
}

template <class S, class A>
void reduce_partials(const A* part, std::int64_t planes, std::int64_t heads, std::int64_t table_heads, std::int64_t rows,
                     std::int64_t size, bool accumulate, S* out, cudaStream_t stream) {
    const dim3 block(32, 8);
    const dim3 grid(static_cast<unsigned>((size + 31) / 32), static_cast<unsigned>(table_heads));
    reduce_partials_kernel<<<grid, block, 0, stream>>>(part, planes, heads, table_heads, rows, size, accumulate, out);
    check_launch("reduce_partials_kernel");
}

}  // namespace rpe::detail::gpu
