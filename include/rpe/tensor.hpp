/// @file tensor.hpp
/// @brief `rpe::tensor_ref`: a non-owning view of a row-major buffer with its shape (and, for the
/// attention's q, k, v, optional strides).
///
/// Every rpe entry point takes its tensors as `tensor_ref`s, so any buffer (a `std::vector`, an
/// `Eigen::Matrix` / `Eigen::Tensor` data pointer, a LibTorch tensor's `data_ptr()`, CUDA memory
/// for the CUDA backend) is used in place: rpe never copies the caller's inputs.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <type_traits>

#include "error.hpp"

namespace rpe {

/// @brief Largest rank a `tensor_ref` holds.
inline constexpr int max_rank = 4;

/// @brief Non-owning view: `data` points at `size()` elements laid out C-order (row-major,
/// last index fastest) with extents `shape[0..rank)`, or, for a view made by
/// tensor_ref::with_strides, at elements `data[Σ index[i]·strides[i]]` (strides in elements).
///
/// Only the attention step's q, k and v accept strided views (rpe::attention_forward /
/// attention_backward on the CPU, e.g. q, k, v read in place from a packed (B, L, 3, H, D)
/// projection); every other argument of every entry point must be contiguous and a strided one
/// is rejected with rpe::invalid_argument (`... is a strided view; expected a contiguous buffer`).
/// @tparam T element type, `const` for inputs.
/// @throws rpe::invalid_argument from the constructor when the rank exceeds 4 or an extent is
///   negative, and rpe::out_of_range when the element count overflows int64.
/// Thread-safety: a plain value; concurrent reads are safe.
template <class T>
struct tensor_ref {
    T* data = nullptr;                             ///< first element (may be null only when size() == 0)
    std::array<std::int64_t, max_rank> shape{};    ///< extents; entries past `rank` are 0
    int rank = 0;                                  ///< number of extents in use
    std::array<std::int64_t, max_rank> strides{};  ///< element strides, used only when `strided`
    bool strided = false;                          ///< false: C-order (strides implied by the shape)

    constexpr tensor_ref() = default;

    /// @brief View `data` with the extents of `dims` (e.g. `{B, H, L, D}`).
    tensor_ref(T* ptr, std::initializer_list<std::int64_t> dims)
        : tensor_ref(ptr, std::span<const std::int64_t>(dims.begin(), dims.size())) {}

    /// @brief View `data` with a run-time list of extents (e.g. a std::vector read from a file).
    /// @throws as the initializer-list constructor (rank > 4, negative extent, overflow).
    tensor_ref(T* ptr, std::span<const std::int64_t> dims) : data(ptr) {
        if (dims.size() > static_cast<std::size_t>(max_rank))
            throw invalid_argument(detail::message("tensor", "rank ", dims.size(), " > ", max_rank));
        for (std::int64_t d : dims) {
            if (d < 0) throw invalid_argument(detail::message("tensor", "extent ", d, " is negative"));
            shape[static_cast<std::size_t>(rank++)] = d;
        }
        (void)size_checked();
    }

    /// @brief A view of const elements converts implicitly from a view of mutable ones.
    template <class U>
    requires(std::is_same_v<const U, T> &&
             !std::is_same_v<U, T>) constexpr tensor_ref(const tensor_ref<U>& other)  // NOLINT(google-explicit-constructor)
        : data(other.data), shape(other.shape), rank(other.rank), strides(other.strides), strided(other.strided) {}

    /// @brief A strided view: element `(i0, i1, ...)` at `ptr[i0·strides[0] + i1·strides[1] + ...]`
    /// (strides in elements, not bytes). Example: q of a packed (B, L, 3, H, D) qkv buffer is
    /// `with_strides(qkv, {B, H, L, D}, {L·3·H·D, D, 3·H·D, 1})`, k starts at `qkv + H·D`, v at
    /// `qkv + 2·H·D`.
    /// @throws rpe::invalid_argument when dims and strides differ in count, the rank exceeds 4, an
    ///   extent or a stride is negative; rpe::out_of_range when the element count overflows int64
    ///   or the span (largest offset + 1) in bytes does.
    static tensor_ref with_strides(T* ptr, std::initializer_list<std::int64_t> dims,
                                   std::initializer_list<std::int64_t> element_strides) {
        return with_strides(ptr, std::span<const std::int64_t>(dims.begin(), dims.size()),
                            std::span<const std::int64_t>(element_strides.begin(), element_strides.size()));
    }

    /// @brief with_strides from run-time lists (e.g. a LibTorch tensor's sizes() and strides()).
    /// @throws as the initializer-list form.
    static tensor_ref with_strides(T* ptr, std::span<const std::int64_t> dims, std::span<const std::int64_t> element_strides) {
        if (dims.size() != element_strides.size())
            throw invalid_argument(detail::message("tensor", "strides has ", element_strides.size(), " entries; expected ",
                                                   dims.size(), ", one per extent"));
        tensor_ref r(ptr, dims);
        int i = 0;
        for (std::int64_t st : element_strides) {
            if (st < 0)
                throw invalid_argument(detail::message("tensor", "strides[", i, "] = ", st, " is negative; expected >= 0"));
            r.strides[static_cast<std::size_t>(i++)] = st;
        }
        r.strided = true;
        if (r.size() != 0) {  // the span in bytes must fit a pointer offset (ptrdiff_t)
            const std::int64_t limit = std::numeric_limits<std::int64_t>::max() / static_cast<std::int64_t>(sizeof(T));
            std::int64_t span = 1;
            for (int j = 0; j < r.rank; ++j) {
                const std::int64_t e = r.shape[static_cast<std::size_t>(j)] - 1, st = r.strides[static_cast<std::size_t>(j)];
                if (st != 0 && e > (limit - span) / st)
                    throw out_of_range(detail::message("tensor", "the span of shape ", r.shape_string(), " with strides ",
                                                       r.strides_string(), " overflows int64 bytes"));
                span += e * st;
            }
        }
        return r;
    }

    /// @brief Stride of dimension `i` in elements (the C-order stride when not `strided`).
    [[nodiscard]] constexpr std::int64_t stride(int i) const {
        if (strided) return strides[static_cast<std::size_t>(i)];
        std::int64_t st = 1;
        for (int j = i + 1; j < rank; ++j) st *= shape[static_cast<std::size_t>(j)];
        return st;
    }

    /// @brief True when the elements lie C-order without gaps (a strided view with C-order
    /// strides, or extents of 1 where the stride does not matter, counts as contiguous).
    [[nodiscard]] constexpr bool contiguous() const {
        if (!strided) return true;
        std::int64_t st = 1;
        for (int j = rank - 1; j >= 0; --j) {
            const std::int64_t e = shape[static_cast<std::size_t>(j)];
            if (e != 1 && strides[static_cast<std::size_t>(j)] != st) return false;
            st *= e;
        }
        return true;
    }

    /// @brief Elements from `data` to the last one the view reaches, inclusive (size() when
    /// contiguous; 0 when empty). Used to tell whether two views may share memory.
    [[nodiscard]] constexpr std::int64_t span() const {
        if (size() == 0) return 0;
        if (!strided) return size();
        std::int64_t n = 1;
        for (int j = 0; j < rank; ++j) n += (shape[static_cast<std::size_t>(j)] - 1) * strides[static_cast<std::size_t>(j)];
        return n;
    }

    /// @brief The strides as text, e.g. `(9216, 64, 1152, 1)`.
    [[nodiscard]] std::string strides_string() const {
        std::string s = "(";
        for (int i = 0; i < rank; ++i) {
            if (i) s += ", ";
            detail::append_part(s, stride(i));
        }
        s += rank == 1 ? ",)" : ")";
        return s;
    }

    /// @brief Number of elements (product of the extents; 1 for rank 0).
    [[nodiscard]] constexpr std::int64_t size() const {
        std::int64_t n = 1;
        for (int i = 0; i < rank; ++i) n *= shape[static_cast<std::size_t>(i)];
        return n;
    }

    /// @brief Extent `i` (0-based).
    [[nodiscard]] constexpr std::int64_t extent(int i) const { return shape[static_cast<std::size_t>(i)]; }

    /// @brief The shape as text, e.g. `(2, 3, 46, 8)`.
    [[nodiscard]] std::string shape_string() const { return detail::shape_string(shape.data(), static_cast<std::size_t>(rank)); }

    /// @brief True when the rank and every extent equal `dims`.
    [[nodiscard]] bool has_shape(std::initializer_list<std::int64_t> dims) const {
        if (static_cast<int>(dims.size()) != rank) return false;
        int i = 0;
        for (std::int64_t d : dims)
            if (shape[static_cast<std::size_t>(i++)] != d) return false;
        return true;
    }

private:
    std::int64_t size_checked() const {
        std::int64_t n = 1;
        for (int i = 0; i < rank; ++i) {
            const std::int64_t d = shape[static_cast<std::size_t>(i)];
            if (d != 0 && n > std::numeric_limits<std::int64_t>::max() / d)
                throw out_of_range(detail::message("tensor", "element count of shape ", shape_string(), " overflows int64"));
            n *= d;
        }
        return n;
    }
};

/// @brief Shape text of `dims`, e.g. `(1, 8, 50)`, for error messages.
inline std::string shape_string(std::initializer_list<std::int64_t> dims) {
    return detail::shape_string(dims.begin(), dims.size());
}

}  // namespace rpe
