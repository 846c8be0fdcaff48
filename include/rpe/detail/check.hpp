/// @file detail/check.hpp
/// @brief Argument checks on tensor views shared by the host API (not API).
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "../error.hpp"
#include "../tensor.hpp"

namespace rpe::detail {

/// @brief Throws rpe::invalid_argument `[rpe.<component>] <name> is a strided view ...; expected a
/// contiguous buffer` for a non-contiguous view (only the attention's q, k, v take strides).
template <class T>
void check_contiguous(const tensor_ref<T>& t, const char* component, std::string_view name) {
    if (!t.contiguous())
        throw invalid_argument(message(component, name, " is a strided view (shape ", t.shape_string(), ", strides ",
                                       t.strides_string(), "); expected a contiguous buffer"));
}

/// @brief Throws rpe::invalid_argument `[rpe.<component>] <name> has shape (...); expected (...)`
/// (compares first; formats the message only on failure), or when the view is strided
/// (check_contiguous).
template <class T>
void check_shape(const tensor_ref<T>& t, const std::vector<std::int64_t>& expected, const char* component,
                 std::string_view name) {
    bool ok = t.rank == static_cast<int>(expected.size());
    for (int i = 0; ok && i < t.rank; ++i) ok = t.extent(i) == expected[static_cast<std::size_t>(i)];
    if (!ok)
        throw invalid_argument(
            message(component, name, " has shape ", t.shape_string(), "; expected ", detail::shape_string(expected)));
    check_contiguous(t, component, name);
}

/// @brief Throws rpe::invalid_argument when a non-empty view has a null data pointer, or when it
/// is strided (check_contiguous).
template <class T>
void check_nonnull(const tensor_ref<T>& t, const char* component, std::string_view name) {
    if (t.data == nullptr && t.size() != 0)
        throw invalid_argument(message(component, name, " is a null buffer of shape ", t.shape_string()));
    check_contiguous(t, component, name);
}

/// @brief For inputs that accept strided views (the attention's q, k, v): throws
/// rpe::invalid_argument for a null non-empty view or a last stride other than 1 (rows of D
/// values must be contiguous; extent 1 excepted).
template <class T>
void check_strided_rows(const tensor_ref<T>& t, const char* component, std::string_view name) {
    if (t.data == nullptr && t.size() != 0)
        throw invalid_argument(message(component, name, " is a null buffer of shape ", t.shape_string()));
    if (t.rank > 0 && t.extent(t.rank - 1) > 1 && t.stride(t.rank - 1) != 1)
        throw invalid_argument(message(component, name, " has strides ", t.strides_string(), " for shape ", t.shape_string(),
                                       "; expected the last stride 1 (each row of D values contiguous)"));
}

/// @brief Throws rpe::invalid_argument when two views' address ranges (first to last element,
/// strided views' gaps included) intersect: an output aliasing another argument would be
/// overwritten while it is read. A view placed in another's gaps is refused too (conservative).
template <class T, class U>
void check_no_overlap(const tensor_ref<T>& a, const tensor_ref<U>& b, const char* component, std::string_view a_name,
                      std::string_view b_name) {
    if (a.data == nullptr || b.data == nullptr || a.size() == 0 || b.size() == 0) return;
    const auto a0 = reinterpret_cast<std::uintptr_t>(a.data);
    const auto b0 = reinterpret_cast<std::uintptr_t>(b.data);
    const auto a1 = a0 + static_cast<std::uintptr_t>(a.span()) * sizeof(T);  // span: strided views too
    const auto b1 = b0 + static_cast<std::uintptr_t>(b.span()) * sizeof(U);
    if (!(a1 <= b0 || b1 <= a0))
        throw invalid_argument(message(component, a_name, " overlaps ", b_name,
                                       " in memory (views are compared by the address range from their first to their last "
                                       "element, the gaps of strided views included); expected separate buffers"));
}

}  // namespace rpe::detail
