/// @file tensor.hpp
/// @brief `rpe::tensor_ref`: a non-owning view of a contiguous row-major buffer with its shape.
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
#include <sstream>
#include <string>
#include <type_traits>

#include "error.hpp"

namespace rpe {

/// @brief Largest rank a `tensor_ref` holds.
inline constexpr int max_rank = 4;

/// @brief Non-owning view: `data` points at `size()` elements laid out C-order (row-major,
/// last index fastest) with extents `shape[0..rank)`.
/// @tparam T element type, `const` for inputs.
/// @throws rpe::invalid_argument from the constructor when the rank exceeds 4 or an extent is
///   negative, and rpe::out_of_range when the element count overflows int64.
/// Thread-safety: a plain value; concurrent reads are safe.
template <class T>
struct tensor_ref {
    T* data = nullptr;                          ///< first element (may be null only when size() == 0)
    std::array<std::int64_t, max_rank> shape{};  ///< extents; entries past `rank` are 0
    int rank = 0;                               ///< number of extents in use

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
        requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
    constexpr tensor_ref(const tensor_ref<U>& other)  // NOLINT(google-explicit-constructor)
        : data(other.data), shape(other.shape), rank(other.rank) {}

    /// @brief Number of elements (product of the extents; 1 for rank 0).
    [[nodiscard]] constexpr std::int64_t size() const {
        std::int64_t n = 1;
        for (int i = 0; i < rank; ++i) n *= shape[static_cast<std::size_t>(i)];
        return n;
    }

    /// @brief Extent `i` (0-based).
    [[nodiscard]] constexpr std::int64_t extent(int i) const { return shape[static_cast<std::size_t>(i)]; }

    /// @brief The shape as text, e.g. `(2, 3, 46, 8)`.
    [[nodiscard]] std::string shape_string() const {
        std::ostringstream os;
        os << '(';
        for (int i = 0; i < rank; ++i) os << (i ? ", " : "") << shape[static_cast<std::size_t>(i)];
        os << (rank == 1 ? ",)" : ")");
        return os.str();
    }

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
                throw out_of_range(detail::message("tensor", "element count of shape ", shape_string(),
                                                   " overflows int64"));
            n *= d;
        }
        return n;
    }
};

/// @brief Shape text of `dims`, e.g. `(1, 8, 50)`, for error messages.
inline std::string shape_string(std::initializer_list<std::int64_t> dims) {
    std::ostringstream os;
    os << '(';
    bool first = true;
    for (std::int64_t d : dims) {
        os << (first ? "" : ", ") << d;
        first = false;
    }
    os << (dims.size() == 1 ? ",)" : ")");
    return os.str();
}

}  // namespace rpe
