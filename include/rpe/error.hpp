/// @file error.hpp
/// @brief The rpe exception hierarchy and the helper that formats messages.
///
/// Each exception of ours derives from exactly one standard exception, so
/// `catch (const std::exception&)` sees it and `catch (const std::invalid_argument&)` sees the
/// argument errors. Messages start with a stable prefix `[rpe.<component>]`, then name the
/// parameter, its value and what was expected.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace rpe {

/// @brief Bad argument at the host API (shape, size, parameter value, policy combination).
class invalid_argument : public std::invalid_argument {
public:
    using std::invalid_argument::invalid_argument;
};

/// @brief A value outside the range a type or a table can hold (ids beyond the id type,
/// sizes beyond 64-bit offsets, a bucket id a mapping produced outside [0, num_buckets)).
class out_of_range : public std::out_of_range {
public:
    using std::out_of_range::out_of_range;
};

/// @brief Failure that is not the caller's argument: unreadable or malformed file, I/O error.
class runtime_error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

namespace detail {

/// @brief Concatenates `[rpe.<component>] ` and every part (streamed with `<<`).
template <class... Parts>
std::string message(const char* component, Parts&&... parts) {
    std::ostringstream os;
    os.precision(17);
    os << "[rpe." << component << "] ";
    (os << ... << std::forward<Parts>(parts));
    return os.str();
}

/// @brief Throws `rpe::invalid_argument` with `message(component, parts...)` when `!cond`.
template <class... Parts>
void require(bool cond, const char* component, Parts&&... parts) {
    if (!cond) throw invalid_argument(message(component, std::forward<Parts>(parts)...));
}

}  // namespace detail
}  // namespace rpe
