/// @file backend/cpu/workspace.hpp
/// @brief Scratch memory of the CPU kernels (not API): one grow-only buffer per calling thread,
/// reused by every later call, so a forward or backward allocates (and page-faults) nothing once
/// warm. rpe::release_cpu_workspace() gives the calling thread's buffer back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace rpe::detail::cpu {

inline int max_threads() {
#if defined(_OPENMP)
    return omp_get_max_threads();
#else
    return 1;
#endif
}
inline int thread_id() {
#if defined(_OPENMP)
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/// @brief The calling thread's grow-only scratch buffer (64-byte aligned, uninitialised).
class arena {
public:
    /// @brief At least `bytes` bytes; the previous contents are lost when it grows.
    /// @throws std::bad_alloc
    std::byte* reserve(std::size_t bytes) {
        if (bytes > capacity_) {
            buffer_.reset();
            capacity_ = 0;
            buffer_.reset(static_cast<std::byte*>(::operator new (bytes, std::align_val_t{64})));
            capacity_ = bytes;
        }
        return buffer_.get();
    }
    void release() {
        buffer_.reset();
        capacity_ = 0;
    }
    [[nodiscard]] std::size_t capacity() const { return capacity_; }
    static arena& of_this_thread() {
        thread_local arena a;
        return a;
    }

private:
    struct aligned_delete {
        void operator()(std::byte* p) const { ::operator delete (p, std::align_val_t{64}); }
    };
    std::unique_ptr<std::byte, aligned_delete> buffer_;
    std::size_t capacity_ = 0;
};

/// @brief The buffers of one kernel call laid out in the calling thread's arena: declare every
/// buffer (thread_scratch, shared_scratch), then allocate() once, before any parallel region (an
/// allocation failure throws there, not inside the region). Contents start uninitialised.
class workspace {
public:
    workspace() : threads_(max_threads()) {}
    workspace(const workspace&) = delete;
    workspace& operator=(const workspace&) = delete;
    /// @brief Reserves `count` elements of `bytes_each` bytes, 64-byte aligned; returns the offset.
    std::size_t add(std::size_t count, std::size_t bytes_each) {
        const std::size_t offset = (bytes_ + 63) / 64 * 64;
        bytes_ = offset + count * bytes_each;
        return offset;
    }
    void allocate() { base_ = arena::of_this_thread().reserve(bytes_ + 64); }
    [[nodiscard]] std::byte* base() const { return base_; }
    [[nodiscard]] int threads() const { return threads_; }

private:
    std::size_t bytes_ = 0;
    std::byte* base_ = nullptr;
    int threads_ = 1;
};

/// @brief At least `n` elements of T for each thread of the team, in a workspace. Every thread's
/// slice starts 64-byte aligned, so vectorised reductions (whose order follows the alignment)
/// give the same bits on every thread.
template <class T>
struct thread_scratch {
    static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>);
    static constexpr std::int64_t per_line = 64 / static_cast<std::int64_t>(sizeof(T)) > 0
                                                 ? 64 / static_cast<std::int64_t>(sizeof(T))
                                                 : 1;
    const workspace* ws;
    std::int64_t per_thread;  ///< elements per thread: n rounded up to whole 64-byte lines
    std::size_t offset;
    thread_scratch(workspace& w, std::int64_t n)
        : ws(&w),
          per_thread((n + per_line - 1) / per_line * per_line),
          offset(w.add(static_cast<std::size_t>(w.threads()) * static_cast<std::size_t>(per_thread), sizeof(T))) {}
    T* mine() const { return reinterpret_cast<T*>(ws->base() + offset) + thread_id() * per_thread; }
};

/// @brief `count` elements of T shared by the team, in a workspace.
template <class T>
struct shared_scratch {
    static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>);
    const workspace* ws;
    std::size_t offset;
    std::int64_t count;
    shared_scratch(workspace& w, std::int64_t n) : ws(&w), offset(w.add(static_cast<std::size_t>(n), sizeof(T))), count(n) {}
    T* data() const { return reinterpret_cast<T*>(ws->base() + offset); }
    [[nodiscard]] bool empty() const { return count == 0; }
};

}  // namespace rpe::detail::cpu

namespace rpe {
/// @brief Frees the calling thread's scratch buffer of the CPU kernels. The kernels keep one
/// grow-only buffer per calling thread (the largest any call needed: for the fused attention
/// about threads·(2·rows·L + …) values), so repeated calls allocate nothing; call this after a
/// large problem to give that memory back. The next call allocates again.
inline void release_cpu_workspace() { detail::cpu::arena::of_this_thread().release(); }
}  // namespace rpe
