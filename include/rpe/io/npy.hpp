/// @file io/npy.hpp
/// @brief Reader and writer of NumPy `.npy` files (format versions 1.0, 2.0 and 3.0).
///
/// Layout of a `.npy` file: the 6-byte magic `\x93NUMPY`, one byte major and one byte minor
/// version, the header length (2 bytes little-endian for 1.0, 4 bytes for 2.0 and 3.0), the
/// header (a Python dict literal such as `{'descr': '<f4', 'fortran_order': False,
/// 'shape': (3, 4), }` padded with spaces and ended by `\n`), then the raw elements.
/// This reader accepts little-endian (`<`) or byte-order-free (`|`) dtypes in C order only.
/// Source: NumPy NEP 1 ("A simple file format for NumPy arrays") and the `numpy.lib.format`
/// specification of the .npy format.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <ios>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include "../error.hpp"
#include "atomic_file.hpp"

namespace rpe::io {

static_assert(std::endian::native == std::endian::little,
              "rpe/io/npy.hpp reads and writes little-endian data in place; big-endian hosts are not supported");

namespace detail {

/// @brief Kind (`'f'`, `'i'`, `'u'`, `'b'`) and item size of a supported numpy descr.
struct npy_dtype {
    char kind = 0;
    std::size_t size = 0;
};

/// @brief Decodes a supported descr (`<f4 <f8 <i4 <i8 |u1 |b1 <u2 <u4 <i2 |i1 <u8`).
/// @return false when `descr` is not one of them.
inline bool npy_decode_dtype(std::string_view descr, npy_dtype& out) {
    struct entry {
        std::string_view descr;
        char kind;
        std::size_t size;
    };
    static constexpr entry table[] = {
        {"<f4", 'f', 4}, {"<f8", 'f', 8}, {"<i4", 'i', 4}, {"<i8", 'i', 8}, {"|u1", 'u', 1}, {"|b1", 'b', 1},
        {"<u2", 'u', 2}, {"<u4", 'u', 4}, {"<i2", 'i', 2}, {"|i1", 'i', 1}, {"<u8", 'u', 8},
    };
    for (const entry& e : table) {
        if (e.descr == descr) {
            out = {e.kind, e.size};
            return true;
        }
    }
    return false;
}

/// @brief The numpy descr of a C++ arithmetic type (`float` → `<f4`, `std::int64_t` → `<i8`,
/// `bool` → `|b1`, ...); empty for types without a supported descr (e.g. `long double`).
template <class T>
constexpr std::string_view npy_descr_of() {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_same_v<U, bool>) {
        return "|b1";
    } else if constexpr (std::is_floating_point_v<U>) {
        if constexpr (std::is_same_v<U, float>)
            return "<f4";
        else if constexpr (std::is_same_v<U, double>)
            return "<f8";
        else
            return "";
    } else if constexpr (std::is_integral_v<U>) {
        if constexpr (std::is_signed_v<U>) {
            if constexpr (sizeof(U) == 1)
                return "|i1";
            else if constexpr (sizeof(U) == 2)
                return "<i2";
            else if constexpr (sizeof(U) == 4)
                return "<i4";
            else if constexpr (sizeof(U) == 8)
                return "<i8";
            else
                return "";
        } else {
            if constexpr (sizeof(U) == 1)
                return "|u1";
            else if constexpr (sizeof(U) == 2)
                return "<u2";
            else if constexpr (sizeof(U) == 4)
                return "<u4";
            else if constexpr (sizeof(U) == 8)
                return "<u8";
            else
                return "";
        }
    } else {
        return "";
    }
}

/// @brief A readable name of a C++ arithmetic type for messages (`float32`, `int64`, `bool`).
template <class T>
std::string npy_type_name() {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_same_v<U, bool>) {
        return "bool";
    } else if constexpr (std::is_floating_point_v<U>) {
        return "float" + std::to_string(sizeof(U) * 8);
    } else {
        return std::string(std::is_signed_v<U> ? "int" : "uint") + std::to_string(sizeof(U) * 8);
    }
}

/// @brief True when the integer `v` is exactly representable in the integral (or bool) type T.
template <class T, class S>
constexpr bool npy_int_fits(S v) {
    static_assert(std::is_integral_v<S> && std::is_integral_v<T>);
    if constexpr (std::is_same_v<std::remove_cv_t<T>, bool>) {
        return v == S{0} || v == S{1};
    } else {
        using L = std::numeric_limits<T>;
        if constexpr (std::is_signed_v<S>) {
            const long long x = static_cast<long long>(v);
            if constexpr (std::is_signed_v<T>)
                return x >= static_cast<long long>(L::min()) && x <= static_cast<long long>(L::max());
            else
                return x >= 0 && static_cast<unsigned long long>(x) <= static_cast<unsigned long long>(L::max());
        } else {
            const unsigned long long x = static_cast<unsigned long long>(v);
            return x <= static_cast<unsigned long long>(L::max());
        }
    }
}

/// @brief Converts a floating value to the floating type T as IEEE narrowing does (round to
/// nearest even), without undefined behaviour for finite values beyond T's range: within half an
/// ulp of T's max they become ±max, further out ±infinity.
template <class T, class S>
T npy_float_to_float(S v) {
    if constexpr (sizeof(T) < sizeof(S)) {
        // IEEE round to nearest: beyond max but below max + ulp(max)/2 is max; from there on ±inf
        // (the tie rounds to even, which is infinity: max's last significand bit is 1)
        constexpr T max = std::numeric_limits<T>::max();
        const S half_ulp = (static_cast<S>(max) - static_cast<S>(std::nextafter(max, T(0)))) / 2;
        if (std::isfinite(v) && std::fabs(v) > static_cast<S>(max)) {
            if (std::fabs(v) < static_cast<S>(max) + half_ulp) return v < 0 ? -max : max;
            return v < 0 ? -std::numeric_limits<T>::infinity() : std::numeric_limits<T>::infinity();
        }
    }
    return static_cast<T>(v);
}

/// @brief Element count of `shape` (0 when an extent is 0), after checking numpy's rule that the
/// product of the non-zero extents times `itemsize` fits int64 (numpy refuses a shape such as
/// (2^39, 2^21, 2^10, 0): "array is too big"). Extents must be >= 0.
/// @param on_overflow called as `on_overflow(product so far, extent)`; must throw.
template <class Shape, class F>
std::uint64_t npy_checked_count(const Shape& shape, std::size_t itemsize, F&& on_overflow) {
    constexpr auto max = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    std::uint64_t nonzero = 1;
    bool empty = false;
    for (std::int64_t e : shape) {
        if (e == 0) {
            empty = true;
            continue;
        }
        const auto ue = static_cast<std::uint64_t>(e);
        if (nonzero > max / itemsize / ue) on_overflow(nonzero, e);
        nonzero *= ue;
    }
    return empty ? 0 : nonzero;
}

/// @brief Cursor over the header text with the small Python-literal grammar numpy writes.
class npy_header_parser {
public:
    npy_header_parser(std::string_view text, const std::string& name) : s_(text), name_(name) {}

    /// @brief Parses the dict; fills descr, fortran_order and shape.
    void parse(std::string& descr, bool& fortran, std::vector<std::int64_t>& shape) {
        bool has_descr = false, has_fortran = false, has_shape = false;
        skip_ws();
        expect('{');
        skip_ws();
        while (!at('}')) {
            const std::string key = parse_string();
            skip_ws();
            expect(':');
            skip_ws();
            if (key == "descr") {
                if (has_descr) fail("duplicate key 'descr'");
                has_descr = true;
                if (!at('\'') && !at('"')) fail("'descr' is not a string (structured dtypes are not supported)");
                descr = parse_string();
            } else if (key == "fortran_order") {
                if (has_fortran) fail("duplicate key 'fortran_order'");
                has_fortran = true;
                fortran = parse_bool();
            } else if (key == "shape") {
                if (has_shape) fail("duplicate key 'shape'");
                has_shape = true;
                shape = parse_shape();
            } else {
                fail("unexpected key '" + key + "'");
            }
            skip_ws();
            if (at(',')) {
                ++pos_;
                skip_ws();
            } else if (!at('}')) {
                fail("expected ',' or '}'");
            }
        }
        ++pos_;  // '}'
        skip_ws();
        if (pos_ != s_.size()) fail("unexpected text after '}'");
        if (!has_descr) fail("missing key 'descr'");
        if (!has_fortran) fail("missing key 'fortran_order'");
        if (!has_shape) fail("missing key 'shape'");
    }

private:
    std::string_view s_;
    const std::string& name_;
    std::size_t pos_ = 0;

    [[noreturn]] void fail(const std::string& what) const {
        throw runtime_error(
            rpe::detail::message("npy", name_, ": header is not a valid dict literal: ", what, " (at offset ", pos_, ")"));
    }
    bool at(char c) const { return pos_ < s_.size() && s_[pos_] == c; }
    void expect(char c) {
        if (!at(c)) fail(std::string("expected '") + c + "'");
        ++pos_;
    }
    void skip_ws() {
        while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
    }
    std::string parse_string() {
        if (!at('\'') && !at('"')) fail("expected a quoted string");
        const char quote = s_[pos_++];
        const std::size_t start = pos_;
        while (pos_ < s_.size() && s_[pos_] != quote) {
            if (s_[pos_] == '\\') fail("escape sequences in strings are not supported");
            if (s_[pos_] == '\n') fail("unterminated string");
            ++pos_;
        }
        if (pos_ >= s_.size()) fail("unterminated string");
        std::string out(s_.substr(start, pos_ - start));
        ++pos_;  // closing quote
        return out;
    }
    bool parse_bool() {
        if (s_.substr(pos_, 4) == "True") {
            pos_ += 4;
            return true;
        }
        if (s_.substr(pos_, 5) == "False") {
            pos_ += 5;
            return false;
        }
        fail("'fortran_order' is not True or False");
    }
    std::int64_t parse_extent() {
        if (at('-')) fail("negative extent in 'shape'");
        if (pos_ >= s_.size() || s_[pos_] < '0' || s_[pos_] > '9') fail("expected an integer in 'shape'");
        std::int64_t v = 0;
        while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
            const int digit = s_[pos_] - '0';
            if (v > (std::numeric_limits<std::int64_t>::max() - digit) / 10) fail("extent in 'shape' overflows int64");
            v = v * 10 + digit;
            ++pos_;
        }
        return v;
    }
    std::vector<std::int64_t> parse_shape() {
        if (!at('(')) fail("'shape' is not a tuple");
        ++pos_;
        skip_ws();
        std::vector<std::int64_t> shape;
        bool trailing_comma = false;
        while (!at(')')) {
            if (shape.size() >= 64) fail("'shape' has more than 64 extents");
            shape.push_back(parse_extent());
            skip_ws();
            trailing_comma = false;
            if (at(',')) {
                ++pos_;
                trailing_comma = true;
                skip_ws();
            } else if (!at(')')) {
                fail("expected ',' or ')' in 'shape'");
            }
        }
        // Python: "(3)" is the int 3, not a tuple; a one-element tuple needs the comma.
        if (shape.size() == 1 && !trailing_comma) fail("'shape' is not a tuple (one extent needs a trailing comma)");
        ++pos_;  // ')'
        return shape;
    }
};

}  // namespace detail

/// @brief An array loaded from a `.npy` file: numpy descr, shape and the raw little-endian
/// element bytes in C order (row-major, last index fastest).
///
/// Supported descrs: `<f4 <f8 <i4 <i8 |u1 |b1 <u2 <u4 <i2 |i1 <u8`.
/// Source: NumPy NEP 1 / the .npy format specification (`numpy.lib.format`).
/// Thread-safety: a plain value; concurrent const calls are safe.
struct npy_array {
    std::string dtype;                ///< numpy descr, e.g. `"<f4"`, `"|u1"`
    std::vector<std::int64_t> shape;  ///< extents, C order; empty for a 0-d array (one element)
    std::vector<std::byte> bytes;     ///< `size() * itemsize()` raw element bytes, little-endian
    std::string source;               ///< file name used in error messages

    /// @brief Number of elements: the product of the extents (1 for a 0-d array).
    [[nodiscard]] std::size_t size() const {
        std::size_t n = 1;
        for (std::int64_t d : shape) n *= static_cast<std::size_t>(d);
        return n;
    }

    /// @brief Bytes per element of `dtype` (0 when the descr is not supported).
    [[nodiscard]] std::size_t itemsize() const {
        detail::npy_dtype d;
        return detail::npy_decode_dtype(dtype, d) ? d.size : 0;
    }

    /// @brief Number of extents.
    [[nodiscard]] std::size_t rank() const { return shape.size(); }

    /// @brief True for a floating dtype (`<f4`, `<f8`).
    [[nodiscard]] bool is_float() const {
        detail::npy_dtype d;
        return detail::npy_decode_dtype(dtype, d) && d.kind == 'f';
    }

    /// @brief Copies the elements converted to the arithmetic type T.
    ///
    /// Integer (and bool) sources convert exactly to any integral T; floating sources convert to
    /// floating T (as IEEE narrowing: finite values beyond T's range become ±max within half an ulp, else ±infinity); integers convert to
    /// floating T with the usual rounding. `bool` as T accepts only the values 0 and 1.
    /// @throws rpe::invalid_argument `[rpe.npy] <file>: dtype <f4 cannot be read as an integer
    ///   type ...` when a floating array is read as an integral T.
    /// @throws rpe::out_of_range `[rpe.npy] <file>: element i (value v) of dtype ... does not fit
    ///   ...` when an integer does not fit T.
    /// @throws rpe::runtime_error `[rpe.npy] <file>: ...` when dtype is unsupported or `bytes`
    ///   does not hold `size()` elements (only possible for a hand-built npy_array).
    template <class T>
    [[nodiscard]] std::vector<T> to() const {
        static_assert(std::is_arithmetic_v<T>, "npy_array::to<T>: T must be an arithmetic type");
        const detail::npy_dtype d = checked_dtype();
        const std::size_t n = size();
        if (d.kind == 'f' && std::is_integral_v<T>)
            throw invalid_argument(rpe::detail::message("npy", source, ": dtype ", dtype, " cannot be read as an integer type (",
                                                        detail::npy_type_name<T>(), ")"));
        std::vector<T> out(n);
        switch (d.kind) {
            case 'f':
                if constexpr (std::is_floating_point_v<T>) {
                    if (d.size == 4)
                        convert<float, T>(out);
                    else
                        convert<double, T>(out);
                }
                break;
            case 'b': convert<std::uint8_t, T>(out, true); break;
            case 'u':
                if (d.size == 1)
                    convert<std::uint8_t, T>(out);
                else if (d.size == 2)
                    convert<std::uint16_t, T>(out);
                else if (d.size == 4)
                    convert<std::uint32_t, T>(out);
                else
                    convert<std::uint64_t, T>(out);
                break;
            default:  // 'i'
                if (d.size == 1)
                    convert<std::int8_t, T>(out);
                else if (d.size == 2)
                    convert<std::int16_t, T>(out);
                else if (d.size == 4)
                    convert<std::int32_t, T>(out);
                else
                    convert<std::int64_t, T>(out);
                break;
        }
        return out;
    }

    /// @brief Copies the elements as T, which must be exactly the stored dtype (`float` for
    /// `<f4`, `double` for `<f8`, `std::int32_t` for `<i4`, `std::uint8_t` for `|u1`, `bool` for
    /// `|b1`, ...).
    /// @throws rpe::invalid_argument `[rpe.npy] <file>: expected dtype <f4 (float32), got <f8`
    ///   when the dtype differs.
    /// @throws rpe::runtime_error as to() for an inconsistent hand-built npy_array.
    template <class T>
    [[nodiscard]] std::vector<T> as() const {
        static_assert(!detail::npy_descr_of<T>().empty(), "npy_array::as<T>: T has no numpy descr");
        constexpr std::string_view want = detail::npy_descr_of<T>();
        if (dtype != want)
            throw invalid_argument(rpe::detail::message("npy", source, ": expected dtype ", want, " (",
                                                        detail::npy_type_name<T>(), "), got ", dtype));
        if constexpr (std::is_same_v<std::remove_cv_t<T>, bool>) {
            return to<bool>();  // bytes other than 0/1 are not valid bool objects: convert, don't copy
        } else {
            (void)checked_dtype();
            std::vector<T> out(size());
            if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
            return out;
        }
    }

private:
    detail::npy_dtype checked_dtype() const {
        detail::npy_dtype d;
        if (!detail::npy_decode_dtype(dtype, d))
            throw runtime_error(rpe::detail::message("npy", source, ": unsupported dtype '", dtype, "'"));
        for (std::int64_t e : shape)
            if (e < 0) throw runtime_error(rpe::detail::message("npy", source, ": negative extent ", e));
        const auto n = static_cast<std::size_t>(detail::npy_checked_count(shape, d.size, [&](std::uint64_t, std::int64_t) {
            throw runtime_error(rpe::detail::message("npy", source, ": shape product overflows"));
        }));
        if (n * d.size != bytes.size())
            throw runtime_error(
                rpe::detail::message("npy", source, ": holds ", bytes.size(), " bytes, shape needs ", n * d.size));
        return d;
    }

    template <class S, class T>
    void convert(std::vector<T>& out, bool is_bool = false) const {
        const std::byte* p = bytes.data();
        for (std::size_t i = 0; i < out.size(); ++i) {
            S v;
            std::memcpy(&v, p + i * sizeof(S), sizeof(S));
            if constexpr (std::is_floating_point_v<S>) {
                out[i] = detail::npy_float_to_float<T>(v);  // T is floating here (checked by to())
            } else {
                if (is_bool) v = static_cast<S>(v != 0);
                if constexpr (std::is_integral_v<T>) {
                    if (!detail::npy_int_fits<T>(v))
                        throw out_of_range(rpe::detail::message("npy", source, ": element ", i, " (value ", +v, ") of dtype ",
                                                                dtype, " does not fit ", detail::npy_type_name<T>()));
                }
                out[i] = static_cast<T>(v);
            }
        }
    }
};

/// @brief Parses the bytes of a `.npy` file (format 1.0, 2.0 or 3.0).
///
/// Layout: magic `\x93NUMPY`, version bytes, header length (uint16 LE for 1.0, uint32 LE for
/// 2.0/3.0), a Python dict literal header with exactly the keys 'descr', 'fortran_order' and
/// 'shape', then exactly `prod(shape) * itemsize` data bytes. Never reads outside `bytes`.
/// Source: NumPy NEP 1 / the .npy format specification (`numpy.lib.format`).
/// @param bytes the whole file.
/// @param name_for_errors the file name quoted in messages.
/// @throws rpe::runtime_error `[rpe.npy] <name>: ...` for: bad magic string; unsupported format
///   version; truncated header; header is not a valid dict literal (or misses 'descr',
///   'fortran_order' or 'shape'); fortran_order True; big-endian or unsupported dtype; shape
///   product overflow; data truncated; trailing bytes after the data.
namespace detail {

/// @brief What a .npy header says: the array without its data bytes, where the data starts and
/// how many bytes it takes. `bytes` must hold at least the header (the data may be missing).
struct npy_layout {
    npy_array array;                ///< source, dtype, shape; bytes empty
    std::uint64_t data_offset = 0;  ///< prefix + header length
    std::uint64_t data_bytes = 0;   ///< elements × item size
};

/// @brief The longest header text read (numpy's own reader refuses headers beyond 10 000 bytes
/// unless told otherwise; this allows the 65 535 of format 1.0 and more).
inline constexpr std::uint64_t npy_max_header_bytes = std::uint64_t{1} << 20;

/// @brief Whether `bytes` holds a whole .npy header (magic, version, length and the header text;
/// false while the prefix is too short to tell).
inline bool npy_header_complete(std::span<const std::byte> bytes) {
    if (bytes.size() < 8) return false;
    const unsigned major = std::to_integer<unsigned>(bytes[6]);
    if ((major != 1 && major != 2 && major != 3) || std::to_integer<unsigned>(bytes[7]) != 0) return true;  // refused at once
    const std::size_t len_bytes = major == 1 ? 2 : 4;
    if (bytes.size() < 8 + len_bytes) return false;
    std::uint64_t header_len = 0;
    for (std::size_t i = 0; i < len_bytes; ++i)
        header_len |= static_cast<std::uint64_t>(std::to_integer<unsigned>(bytes[8 + i])) << (8 * i);
    return header_len > npy_max_header_bytes || bytes.size() - 8 - len_bytes >= header_len;  // too long: refused at once
}

/// @brief Parses the magic, version and header of a .npy file (see parse_npy()).
/// @throws rpe::runtime_error as parse_npy() for everything before the data.
inline npy_layout parse_npy_layout(std::span<const std::byte> bytes, const std::string& name) {
    auto fail = [&](const auto&... parts) -> void { throw runtime_error(rpe::detail::message("npy", name, ": ", parts...)); };
    static constexpr unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
    const std::size_t nmagic = bytes.size() < 6 ? bytes.size() : 6;
    for (std::size_t i = 0; i < nmagic; ++i)
        if (std::to_integer<unsigned char>(bytes[i]) != magic[i]) fail("bad magic string (not a .npy file)");
    if (bytes.size() < 8) fail("truncated header (", bytes.size(), " bytes)");
    const unsigned major = std::to_integer<unsigned>(bytes[6]);
    const unsigned minor = std::to_integer<unsigned>(bytes[7]);
    if ((major != 1 && major != 2 && major != 3) || minor != 0)
        fail("unsupported format version ", major, ".", minor, " (supported: 1.0, 2.0, 3.0)");
    const std::size_t len_bytes = major == 1 ? 2 : 4;
    if (bytes.size() < 8 + len_bytes) fail("truncated header (", bytes.size(), " bytes)");
    std::uint64_t header_len = 0;
    for (std::size_t i = 0; i < len_bytes; ++i)
        header_len |= static_cast<std::uint64_t>(std::to_integer<unsigned>(bytes[8 + i])) << (8 * i);
    const std::size_t prefix = 8 + len_bytes;
    if (header_len > npy_max_header_bytes)
        fail("header length ", header_len, " exceeds the ", npy_max_header_bytes, " bytes this reader accepts");
    if (header_len > bytes.size() - prefix)
        fail("truncated header (header length ", header_len, ", only ", bytes.size() - prefix, " bytes follow)");

    const std::string_view text(reinterpret_cast<const char*>(bytes.data() + prefix), static_cast<std::size_t>(header_len));
    npy_layout out;
    npy_array& a = out.array;
    a.source = name;
    bool fortran = false;
    npy_header_parser(text, name).parse(a.dtype, fortran, a.shape);
    if (fortran) fail("fortran_order True is not supported (C order only)");
    npy_dtype d;
    if (!a.dtype.empty() && a.dtype[0] == '>') fail("big-endian dtype '", a.dtype, "' is not supported");
    if (!npy_decode_dtype(a.dtype, d)) fail("unsupported dtype '", a.dtype, "'");

    const std::uint64_t count = npy_checked_count(a.shape, d.size, [&](std::uint64_t nonzero, std::int64_t e) {
        fail("shape product overflows: ", nonzero, " * ", e, " elements of ", d.size, " bytes exceed int64 (",
             "the product of the non-zero extents must fit, as numpy requires, even when an extent is 0)");
    });
    out.data_offset = prefix + header_len;
    out.data_bytes = count * d.size;
    return out;
}

}  // namespace detail

inline npy_array parse_npy(std::span<const std::byte> bytes, const std::string& name_for_errors) {
    const std::string& name = name_for_errors;
    detail::npy_layout l = detail::parse_npy_layout(bytes, name);
    const std::uint64_t need = l.data_bytes;
    const std::size_t have = bytes.size() - static_cast<std::size_t>(l.data_offset);
    if (have < need)
        throw runtime_error(
            rpe::detail::message("npy", name, ": data truncated: shape needs ", need, " bytes, file holds ", have));
    if (have > need)
        throw runtime_error(
            rpe::detail::message("npy", name, ": trailing bytes: shape needs ", need, " bytes, file holds ", have));
    const std::byte* data = bytes.data() + l.data_offset;
    l.array.bytes.assign(data, data + need);
    return std::move(l.array);
}

/// @brief Reads a whole `.npy` file and parses it with parse_npy().
///
/// The file is read in 64 KiB chunks, so the buffer never exceeds the bytes that are actually
/// there (the size a stream reports is not trusted: for a directory it is huge), and once the
/// header is in, no further than one byte past the data it announces (a 20 GB file or an endless
/// FIFO behind a small header is refused as "trailing bytes" after reading that much).
/// Source: NumPy NEP 1 / the .npy format specification (`numpy.lib.format`).
/// @throws rpe::runtime_error `[rpe.npy] <path>: is a directory, expected a .npy file`, `cannot
///   open file` or `read failed`, and everything parse_npy() throws.
inline npy_array load_npy(const std::string& path) {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec))
        throw runtime_error(rpe::detail::message("npy", path, ": is a directory, expected a .npy file"));
    std::ifstream in(path, std::ios::binary);
    if (!in) throw runtime_error(rpe::detail::message("npy", path, ": cannot open file"));
    std::vector<std::byte> buf;
    std::vector<char> chunk(std::size_t{1} << 16);
    bool checked_magic = false;
    // once the header is in, the file's size is known: read no further than one byte past it
    // (a 20 GB file or an endless FIFO behind a small header is not buffered)
    constexpr std::uint64_t unknown = std::numeric_limits<std::uint64_t>::max();
    std::uint64_t limit = unknown, data_bytes = 0;
    while (in && (limit == unknown || buf.size() <= limit)) {
        const std::uint64_t want =
            limit == unknown ? chunk.size() : std::min<std::uint64_t>(chunk.size(), limit - buf.size() + 1);
        in.read(chunk.data(), static_cast<std::streamsize>(want));
        const auto got = static_cast<std::size_t>(in.gcount());
        const auto* first = reinterpret_cast<const std::byte*>(chunk.data());
        buf.insert(buf.end(), first, first + got);
        if (!checked_magic && buf.size() >= 6) {
            // not a .npy file (e.g. /dev/zero or a large unrelated file): fail before reading it all
            checked_magic = true;
            if (std::memcmp(buf.data(), "\x93NUMPY", 6) != 0) return parse_npy(buf, path);  // throws: bad magic
        }
        if (limit == unknown && detail::npy_header_complete(buf)) {
            const detail::npy_layout l = detail::parse_npy_layout(buf, path);  // throws for a bad header
            data_bytes = l.data_bytes;
            limit = l.data_offset + l.data_bytes;
        }
    }
    if (in.bad()) throw runtime_error(rpe::detail::message("npy", path, ": read failed"));
    if (limit != unknown && buf.size() > limit)
        throw runtime_error(
            rpe::detail::message("npy", path, ": trailing bytes: shape needs ", data_bytes, " bytes, the file holds more"));
    return parse_npy(buf, path);
}

/// @brief The bytes of a format-1.0 `.npy` file before its data, for `shape` and element type T
/// (magic, version, header length, the header dict padded with spaces so that the data starts at
/// a multiple of 64 bytes); the data, `prod(shape)` elements of T in C order, follows.
/// @tparam T an arithmetic type with a numpy descr (`float`, `double`, `bool`, 8/16/32/64-bit
///   signed or unsigned integers).
/// @throws rpe::invalid_argument `[rpe.npy] ...` for more than 64 extents (what load_npy reads), a
///   negative extent, an element count that overflows int64, or a header longer than format 1.0
///   allows.
/// Source: NumPy NEP 1 / the .npy format specification (`numpy.lib.format`).
template <class T>
std::vector<std::byte> encode_npy_header(std::span<const std::int64_t> shape) {
    constexpr std::string_view descr = detail::npy_descr_of<T>();
    static_assert(!descr.empty(), "encode_npy_header<T>: T has no numpy descr");
    if (shape.size() > 64)  // what load_npy reads back
        throw invalid_argument(rpe::detail::message("npy", "shape has ", shape.size(), " extents; expected at most 64"));
    std::string dims;  // Python tuple syntax: "", "3,", "2, 3"
    for (std::size_t i = 0; i < shape.size(); ++i) {
        const std::int64_t e = shape[i];
        if (e < 0) throw invalid_argument(rpe::detail::message("npy", "extent ", e, " is negative"));
        if (i != 0) dims += ", ";
        dims += std::to_string(e);
    }
    // the reader's rule: the non-zero extents' product must fit, so every file written reads back
    (void)detail::npy_checked_count(shape, sizeof(T), [](std::uint64_t, std::int64_t) {
        throw invalid_argument(rpe::detail::message("npy", "element count overflows int64"));
    });
    if (shape.size() == 1) dims += ',';
    std::string header = "{'descr': '" + std::string(descr) + "', 'fortran_order': False, 'shape': (" + dims + "), }";
    const std::size_t unpadded = 10 + header.size() + 1;  // prefix + dict + '\n'
    header.append((64 - unpadded % 64) % 64, ' ');
    header += '\n';
    if (header.size() > 65535)
        throw invalid_argument(rpe::detail::message("npy", "header of ", header.size(), " bytes does not fit format 1.0"));
    std::vector<std::byte> out(10 + header.size());
    static constexpr unsigned char prefix[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
    std::memcpy(out.data(), prefix, 8);
    out[8] = static_cast<std::byte>(header.size() & 0xff);
    out[9] = static_cast<std::byte>(header.size() >> 8);
    std::memcpy(out.data() + 10, header.data(), header.size());
    return out;
}

/// @brief Encodes `data` with `shape` as the bytes of a format-1.0 `.npy` file (C order; the
/// header of encode_npy_header(), then the data).
/// @tparam T an arithmetic type with a numpy descr (`float`, `double`, `bool`, 8/16/32/64-bit
///   signed or unsigned integers).
/// @param data `prod(shape)` elements, row-major (may be null when that product is 0).
/// @throws rpe::invalid_argument as encode_npy_header().
/// Source: NumPy NEP 1 / the .npy format specification (`numpy.lib.format`).
template <class T>
std::vector<std::byte> encode_npy(const T* data, std::span<const std::int64_t> shape) {
    std::vector<std::byte> out = encode_npy_header<T>(shape);
    const std::size_t header = out.size();
    const std::uint64_t count = detail::npy_checked_count(shape, sizeof(T), [](std::uint64_t, std::int64_t) {});
    out.resize(header + count * sizeof(T));
    if (count != 0) std::memcpy(out.data() + header, data, count * sizeof(T));
    return out;
}

/// @brief Writes `data` with `shape` to `path` as a format-1.0 `.npy` file (see encode_npy()),
/// all or nothing: through a temporary file in the same folder renamed over `path` once complete
/// (write_file_atomically), so a failed write leaves no partial file and an existing `path`
/// unchanged.
/// @throws rpe::invalid_argument as encode_npy_header(), or `[rpe.npy] path = ''; expected a file
///   name` for an empty path (before any file is touched).
/// @throws rpe::runtime_error `[rpe.npy] <path>: cannot create a temporary file in its folder
///   (...)`, `write failed (File too large)`, ... `; <path> is unchanged` (see atomic_file).
/// Source: NumPy NEP 1 / the .npy format specification (`numpy.lib.format`).
template <class T>
void save_npy(const std::string& path, const T* data, std::span<const std::int64_t> shape) {
    const std::vector<std::byte> header = encode_npy_header<T>(shape);  // no copy of the data
    const std::uint64_t count = detail::npy_checked_count(shape, sizeof(T), [](std::uint64_t, std::int64_t) {});
    atomic_file f(path, "npy");
    f.write(std::span<const std::byte>(header));
    if (count != 0) f.write(std::as_bytes(std::span<const T>(data, static_cast<std::size_t>(count))));
    f.commit();
}

}  // namespace rpe::io
