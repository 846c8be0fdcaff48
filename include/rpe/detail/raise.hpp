/// @file detail/raise.hpp
/// @brief The throwing checks of the policies, without the exception headers (not API):
/// rpe::detail::require and rpe::detail::message_part.
///
/// The policy headers (index/, mapping/, rope/) are included by every unit, host and device;
/// `<stdexcept>` and `<string>` alone preprocess to ~29k lines. So a policy's `validate()` calls
/// detail::require from here, which formats nothing: on failure it hands the parts to
/// rpe::detail::raise_invalid_argument, a function template declared here and defined in
/// <rpe/error.hpp> (where `<stdexcept>` and `<string>` already are). A unit that calls a
/// policy's `validate()` (or a mapping's `num_buckets()`) must include <rpe/error.hpp>, as every
/// rpe entry point does (term, bucket ids, make_term, attention, rotary); without it the program
/// fails to link with an undefined `rpe::detail::raise_invalid_argument<void>`.
#pragma once

#include <type_traits>

namespace rpe::detail {

/// @brief One part of an error message, stored without formatting: text (char pointers, char
/// arrays, and any `x` with `x.data()` / `x.size()` of chars such as std::string), a char, a bool
/// (printed `1` / `0`), an integer, an enumeration (its value), a float or double (17 significant
/// digits) or another pointer (hexadecimal). Formatted by rpe::detail::append_part, so a message
/// reads byte for byte as one built by rpe::detail::message.
struct message_part {
    /// @brief What the part holds.
    enum class kind : unsigned char { text, signed_int, unsigned_int, float32, float64, float_long, character, boolean, pointer };
    kind k = kind::text;            ///< the alternative held
    const char* text = "";          ///< kind::text: the characters (not null-terminated)
    unsigned long long length = 0;  ///< kind::text: their number
    long long i = 0;                ///< kind::signed_int
    unsigned long long u = 0;       ///< kind::unsigned_int
    double d = 0.0;                 ///< kind::float64
    float f = 0.0f;                 ///< kind::float32
    long double ld = 0.0L;          ///< kind::float_long
    char c = '\0';                  ///< kind::character
    bool b = false;                 ///< kind::boolean
    const void* p = nullptr;        ///< kind::pointer

    message_part() = default;

    /// @brief The part of `v` (see the class comment for the accepted types).
    template <class T>
    message_part(const T& v) {  // NOLINT(google-explicit-constructor): built from each argument of require
        using U = std::remove_cvref_t<T>;
        if constexpr (std::is_array_v<U>) {
            static_assert(std::is_same_v<std::remove_cv_t<std::remove_extent_t<U>>, char>,
                          "rpe: an array message part must be text");
            set_text(v, __builtin_strlen(v));
        } else if constexpr (std::is_same_v<U, const char*> || std::is_same_v<U, char*>) {
            set_text(v, __builtin_strlen(v));
        } else if constexpr (requires {
                                 static_cast<const char*>(v.data());
                                 v.size();
                             }) {
            set_text(v.data(), static_cast<unsigned long long>(v.size()));
        } else if constexpr (std::is_same_v<U, char>) {
            k = kind::character;
            c = v;
        } else if constexpr (std::is_same_v<U, bool>) {
            k = kind::boolean;
            b = v;
        } else if constexpr (std::is_enum_v<U>) {
            *this = message_part(static_cast<std::underlying_type_t<U>>(v));
        } else if constexpr (std::is_integral_v<U> && std::is_signed_v<U>) {
            k = kind::signed_int;
            i = v;
        } else if constexpr (std::is_integral_v<U>) {
            k = kind::unsigned_int;
            u = v;
        } else if constexpr (std::is_same_v<U, float>) {
            k = kind::float32;
            f = v;
        } else if constexpr (std::is_same_v<U, double>) {
            k = kind::float64;
            d = v;
        } else if constexpr (std::is_same_v<U, long double>) {
            k = kind::float_long;
            ld = v;
        } else if constexpr (std::is_pointer_v<U>) {
            k = kind::pointer;
            p = static_cast<const void*>(v);
        } else {
            static_assert(sizeof(T) == 0, "rpe: a message part must be text, a char, a number, an enum or a pointer");
        }
    }

private:
    void set_text(const char* s, unsigned long long n) {
        k = kind::text;
        text = s;
        length = n;
    }
};

/// @brief Throws rpe::invalid_argument with the message `[rpe.<component>] ` followed by the
/// `count` parts. Declared here, defined in <rpe/error.hpp> (see the file comment); a template
/// only so that its definition may come later in the unit than its use.
template <class = void>
[[noreturn]] void raise_invalid_argument(const char* component, const message_part* parts, int count);

/// @brief Throws rpe::invalid_argument `[rpe.<component>] <parts...>` when `!cond` (the parts
/// are formatted only then, by <rpe/error.hpp>).
template <class... Parts>
void require(bool cond, const char* component, const Parts&... parts) {
    if (!cond) {
        const message_part list[sizeof...(Parts) + 1] = {message_part(parts)...};
        raise_invalid_argument(component, list, static_cast<int>(sizeof...(Parts)));
    }
}

}  // namespace rpe::detail
