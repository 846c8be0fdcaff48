/// @file detail/format.hpp
/// @brief The message formatter of rpe's exceptions on std::string and std::to_chars (not API):
/// no `<sstream>`, `<iostream>` or locale in the core headers.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <concepts>
#include <type_traits>

namespace rpe::detail {

/// @brief Appends one message part to `s`: text (char pointers, strings, string views), a char,
/// a bool (`1` / `0`, as a stream prints it), an integer, an enumeration (its value), or a
/// floating-point value with 17 significant digits (`%.17g`, as the former stream formatting).
template <class T>
void append_part(std::string& s, const T& v) {
    using U = std::remove_cvref_t<T>;
    if constexpr (std::is_convertible_v<const T&, std::string_view>) {
        s += std::string_view(v);
    } else if constexpr (std::is_same_v<U, char>) {
        s += v;
    } else if constexpr (std::is_same_v<U, bool>) {
        s += v ? '1' : '0';
    } else if constexpr (std::is_enum_v<U>) {
        append_part(s, static_cast<std::underlying_type_t<U>>(v));
    } else if constexpr (std::is_integral_v<U>) {
        char buf[24];
        const auto r = std::to_chars(buf, buf + sizeof buf, v);
        s.append(buf, r.ptr);
    } else if constexpr (std::is_floating_point_v<U>) {
        char buf[64];
        const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::general, 17);
        s.append(buf, r.ptr);
    } else if constexpr (std::is_pointer_v<U>) {
        char buf[24] = "0x";
        const auto r = std::to_chars(buf + 2, buf + sizeof buf, reinterpret_cast<std::uintptr_t>(v), 16);
        s.append(buf, r.ptr);
    } else {
        static_assert(sizeof(T) == 0, "rpe: a message part must be text, a char, a number, an enum or a pointer");
    }
}

/// @brief The one shape printer of rpe (error messages, the CLI, the file readers, the PyTorch
/// operators): `n` extents as `(2, 3, 4)`; rank 1 as `(5,)`, rank 0 as `()` (Python's tuple).
inline std::string shape_string(const std::int64_t* dims, std::size_t n) {
    std::string s = "(";
    for (std::size_t i = 0; i < n; ++i) {
        if (i) s += ", ";
        append_part(s, dims[i]);
    }
    s += n == 1 ? ",)" : ")";
    return s;
}

/// @brief shape_string of a contiguous range of int64 extents (`std::vector<std::int64_t>`,
/// `std::span`, `std::array`, `at::IntArrayRef`, ...).
template <class R>
requires requires(const R& r) {
    { r.data() } -> std::convertible_to<const std::int64_t*>;
    r.size();
}
std::string shape_string(const R& dims) { return shape_string(dims.data(), static_cast<std::size_t>(dims.size())); }

/// @brief Concatenates every part (append_part) into one string.
template <class... Parts>
std::string concat(const Parts&... parts) {
    std::string s;
    (append_part(s, parts), ...);
    return s;
}

}  // namespace rpe::detail
