/// @file error.hpp
/// @brief The rpe exception hierarchy and the helper that formats messages.
///
/// Each exception of ours derives from rpe::error and from exactly one standard exception, so
/// `catch (const std::exception&)` sees it and `catch (const std::invalid_argument&)` sees the
/// argument errors. Messages start with a stable prefix `[rpe.<component>]`, then name the
/// parameter, its value and what was expected.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "detail/format.hpp"
#include "detail/raise.hpp"

namespace rpe {

/// @brief Base of every exception rpe throws: `catch (const rpe::error& e)` catches them all
/// (each also derives from exactly one standard exception, see below).
/// Every message starts with a stable id in brackets, `[rpe.<component>]` (e.g. `[rpe.term]`,
/// `[rpe.attention]`, `[rpe.bucket_ids]`, `[rpe.npy]`, `[rpe.cuda]`), then names the parameter,
/// its value and what was expected; docs/errors.md lists the ids.
class error {
public:
    virtual ~error() = default;
    /// @brief The whole message, `[rpe.<component>] ...`.
    [[nodiscard]] virtual const char* what() const noexcept = 0;
    /// @brief The stable id of the message: `rpe.<component>` (empty if the message has none).
    [[nodiscard]] std::string_view id() const noexcept {
        const std::string_view m = what();
        if (m.size() < 2 || m[0] != '[') return {};
        const auto end = m.find(']');
        return end == std::string_view::npos ? std::string_view{} : m.substr(1, end - 1);
    }

protected:
    error() = default;
    error(const error&) = default;
    error& operator=(const error&) = default;
};

/// @brief Bad argument at the host API (shape, size, parameter value, policy combination).
class invalid_argument : public std::invalid_argument, public error {
public:
    using std::invalid_argument::invalid_argument;
    [[nodiscard]] const char* what() const noexcept override { return std::invalid_argument::what(); }
};

/// @brief A feature the chosen backend does not support (e.g. strided q/k/v or saved
/// probabilities on the CUDA attention; see rpe::attention_capabilities). An argument error:
/// `catch (const rpe::invalid_argument&)` sees it. Message:
/// `[rpe.<component>] <feature> is not supported by the <backend> backend`.
class not_supported : public invalid_argument {
public:
    using invalid_argument::invalid_argument;
};

/// @brief A value outside the range a type or a table can hold (ids beyond the id type,
/// sizes beyond 64-bit offsets, a bucket id a mapping produced outside [0, num_buckets)).
class out_of_range : public std::out_of_range, public error {
public:
    using std::out_of_range::out_of_range;
    [[nodiscard]] const char* what() const noexcept override { return std::out_of_range::what(); }
};

/// @brief Failure that is not the caller's argument: unreadable or malformed file, I/O error.
class runtime_error : public std::runtime_error, public error {
public:
    using std::runtime_error::runtime_error;
    [[nodiscard]] const char* what() const noexcept override { return std::runtime_error::what(); }
};

namespace detail {

/// @brief Concatenates `[rpe.<component>] ` and every part (detail::append_part: text, numbers
/// with 17 significant digits, enums, pointers).
template <class... Parts>
std::string message(const char* component, const Parts&... parts) {
    std::string s = "[rpe.";
    s += component;
    s += "] ";
    (append_part(s, parts), ...);
    return s;
}

/// @brief Appends one stored message part (detail::require) to `s`, as append_part formats its value.
inline void append_part(std::string& s, const message_part& part) {
    using kind = message_part::kind;
    switch (part.k) {
        case kind::text: s.append(part.text, static_cast<std::size_t>(part.length)); break;
        case kind::signed_int: append_part(s, part.i); break;
        case kind::unsigned_int: append_part(s, part.u); break;
        case kind::float32: append_part(s, part.f); break;
        case kind::float64: append_part(s, part.d); break;
        case kind::float_long: append_part(s, part.ld); break;
        case kind::character: append_part(s, part.c); break;
        case kind::boolean: append_part(s, part.b); break;
        case kind::pointer: append_part(s, part.p); break;
    }
}

/// @brief Definition of the declaration in detail/raise.hpp: throws rpe::invalid_argument
/// `[rpe.<component>] <parts...>`.
template <class>
[[noreturn]] void raise_invalid_argument(const char* component, const message_part* parts, int count) {
    std::string s = "[rpe.";
    s += component;
    s += "] ";
    for (int i = 0; i < count; ++i) append_part(s, parts[i]);
    throw invalid_argument(s);
}

}  // namespace detail
}  // namespace rpe
