/// @file io/safetensors.hpp
/// @brief Reader of `.safetensors` files with zero-copy, aligned tensor views.
///
/// Layout of a `.safetensors` file: an 8-byte little-endian unsigned header length `n`, then
/// `n` bytes of UTF-8 JSON (an object mapping each tensor name to `{"dtype": "F32", "shape":
/// [..], "data_offsets": [begin, end]}`, plus an optional `"__metadata__"` object of string to
/// string), then the data buffer. Offsets are relative to the first byte after the header.
/// Source: the safetensors format by Hugging Face (https://github.com/huggingface/safetensors).
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <ios>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../error.hpp"
#include "../tensor.hpp"

namespace rpe::io {

static_assert(std::endian::native == std::endian::little,
              "rpe/io/safetensors.hpp views little-endian data in place; big-endian hosts are not supported");

namespace detail {

/// @brief Bytes per element of a safetensors dtype string; 0 for an unknown one.
inline std::size_t safetensors_dtype_size(std::string_view dtype) {
    struct entry {
        std::string_view name;
        std::size_t size;
    };
    static constexpr entry table[] = {
        {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
        {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}, {"C64", 8},
    };
    for (const entry& e : table)
        if (e.name == dtype) return e.size;
    return 0;
}

/// @brief The safetensors dtype string of a C++ type that can be viewed in place (`float` →
/// `F32`, `double` → `F64`, `std::int64_t` → `I64`, `std::int32_t` → `I32`, `std::uint8_t` →
/// `U8`, and likewise I8, I16, U16, U32, U64); empty for other types (including `bool`).
template <class T>
constexpr std::string_view safetensors_dtype_of() {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_same_v<U, bool>) {
        return "";
    } else if constexpr (std::is_same_v<U, float>) {
        return "F32";
    } else if constexpr (std::is_same_v<U, double>) {
        return "F64";
    } else if constexpr (std::is_integral_v<U> && !std::is_same_v<U, char>) {
        if constexpr (std::is_signed_v<U>) {
            if constexpr (sizeof(U) == 1)
                return "I8";
            else if constexpr (sizeof(U) == 2)
                return "I16";
            else if constexpr (sizeof(U) == 4)
                return "I32";
            else if constexpr (sizeof(U) == 8)
                return "I64";
            else
                return "";
        } else {
            if constexpr (sizeof(U) == 1)
                return "U8";
            else if constexpr (sizeof(U) == 2)
                return "U16";
            else if constexpr (sizeof(U) == 4)
                return "U32";
            else if constexpr (sizeof(U) == 8)
                return "U64";
            else
                return "";
        }
    } else {
        return "";
    }
}

/// @brief Frees a buffer from `operator new[](n, std::align_val_t{64})`.
struct aligned_delete {
    void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{64}); }
};

/// @brief Allocates `n` bytes (at least 1) aligned to 64 bytes, owned by a shared pointer.
inline std::shared_ptr<std::byte> allocate_aligned_64(std::size_t n) {
    auto* p = static_cast<std::byte*>(::operator new[](n == 0 ? 1 : n, std::align_val_t{64}));
    return std::shared_ptr<std::byte>(p, aligned_delete{});
}

}  // namespace detail

/// @brief A parsed `.safetensors` file: the tensor directory, the `__metadata__` strings and
/// the data buffer, kept in memory that is 64-byte aligned at the first data byte.
///
/// Layout: 8-byte little-endian header length `n`; `n` bytes of JSON `{name: {"dtype",
/// "shape", "data_offsets": [begin, end]}, "__metadata__": {key: value}}`; the data buffer
/// (offsets relative to its first byte). Every entry is validated on load: known dtype,
/// non-negative shape, `begin <= end <= buffer size`, `end - begin == prod(shape) * dtype
/// size`, no two tensors overlapping. Gaps between tensors and unused bytes at the end are
/// accepted.
/// Source: the safetensors format by Hugging Face (https://github.com/huggingface/safetensors).
/// Thread-safety: immutable after load; concurrent const calls are safe. Copies share the
/// (read-only) buffer, so views stay valid while any copy lives.
class safetensors_file {
public:
    /// @brief Directory entry of one tensor: dtype string (`"F32"`, ...), shape, and byte range
    /// `[begin, end)` in the data buffer.
    struct tensor_info {
        std::string dtype;                ///< safetensors dtype, e.g. `"F32"`, `"BF16"`, `"I64"`
        std::vector<std::int64_t> shape;  ///< extents, row-major; empty for a scalar
        std::int64_t begin = 0;           ///< first byte, relative to the data buffer
        std::int64_t end = 0;             ///< one past the last byte
    };

    /// @brief An empty file object: no tensors, no metadata (assign a load() or parse() result).
    safetensors_file() = default;

    /// @brief Largest header accepted (100 MB); a larger length is treated as corrupt.
    static constexpr std::uint64_t max_header_size = 100u * 1000u * 1000u;

    /// @brief Reads and validates the file at `path` (the data are read straight into the
    /// aligned buffer).
    /// @throws rpe::runtime_error `[rpe.safetensors] <path>: is a directory, expected a
    ///   .safetensors file`, `cannot open file` / `read failed`, and everything parse() throws
    ///   for a malformed file.
    static safetensors_file load(const std::string& path) {
        std::error_code ec;
        if (std::filesystem::is_directory(path, ec))
            throw runtime_error(rpe::detail::message("safetensors", path, ": is a directory, expected a .safetensors file"));
        std::ifstream in(path, std::ios::binary | std::ios::ate);
        if (!in) throw runtime_error(rpe::detail::message("safetensors", path, ": cannot open file"));
        const std::streamoff end = in.tellg();
        if (end < 0) throw runtime_error(rpe::detail::message("safetensors", path, ": cannot determine the file size"));
        const auto file_size = static_cast<std::uint64_t>(end);
        in.seekg(0);
        safetensors_file f;
        f.name_ = path;
        unsigned char len[8] = {};
        if (file_size < 8) f.fail("file is shorter than 8 bytes (", file_size, " bytes)");
        if (!in.read(reinterpret_cast<char*>(len), 8)) f.fail("read failed");
        const std::uint64_t n = f.check_header_length(len, file_size);
        std::string header(static_cast<std::size_t>(n), '\0');
        if (n != 0 && !in.read(header.data(), static_cast<std::streamsize>(n))) f.fail("read failed");
        f.size_ = static_cast<std::size_t>(file_size - 8 - n);
        f.data_ = detail::allocate_aligned_64(f.size_);
        if (f.size_ != 0 && !in.read(reinterpret_cast<char*>(f.data_.get()), static_cast<std::streamsize>(f.size_)))
            f.fail("read failed");
        f.parse_header(header);
        return f;
    }

    /// @brief Validates the bytes of a `.safetensors` file and copies its data section into a
    /// 64-byte aligned buffer.
    /// @param bytes the whole file.
    /// @param name the file name quoted in messages.
    /// @throws rpe::runtime_error `[rpe.safetensors] <name>: ...` when: the file is shorter than
    ///   8 bytes; the header length exceeds the file or 100 MB; the header is not valid JSON (or
    ///   not an object, or nested too deeply); an entry is not an object, misses `dtype`,
    ///   `shape` or `data_offsets` or has one of the wrong JSON type; the dtype is unknown; an
    ///   extent is negative or the shape product overflows; `data_offsets` is not two
    ///   non-negative integers with `begin <= end <= buffer size`; `end - begin` differs from
    ///   `prod(shape) * dtype size`; two tensors overlap; a `__metadata__` value is not a
    ///   string; a tensor name appears twice.
    static safetensors_file parse(std::vector<std::byte> bytes, std::string name) {
        safetensors_file f;
        f.name_ = std::move(name);
        if (bytes.size() < 8) f.fail("file is shorter than 8 bytes (", bytes.size(), " bytes)");
        unsigned char len[8];
        std::memcpy(len, bytes.data(), 8);
        const std::uint64_t n = f.check_header_length(len, bytes.size());
        const std::string header(reinterpret_cast<const char*>(bytes.data() + 8), static_cast<std::size_t>(n));
        f.size_ = bytes.size() - 8 - static_cast<std::size_t>(n);
        f.data_ = detail::allocate_aligned_64(f.size_);
        if (f.size_ != 0) std::memcpy(f.data_.get(), bytes.data() + 8 + n, f.size_);
        bytes.clear();
        bytes.shrink_to_fit();
        f.parse_header(header);
        return f;
    }

    /// @brief The file name used in messages (the path given to load(), or parse()'s name).
    [[nodiscard]] const std::string& file_name() const { return name_; }

    /// @brief Number of tensors.
    [[nodiscard]] std::size_t size() const { return order_.size(); }

    /// @brief Size in bytes of the data buffer (the file after the header).
    [[nodiscard]] std::size_t data_size() const { return size_; }

    /// @brief True when the file holds a tensor called `name`.
    [[nodiscard]] bool contains(std::string_view name) const { return tensors_.find(name) != tensors_.end(); }

    /// @brief Tensor names in file order (ascending data offset; ties by name).
    [[nodiscard]] std::vector<std::string> names() const { return order_; }

    /// @brief The `__metadata__` key/value strings (empty when the file has none).
    [[nodiscard]] const std::map<std::string, std::string>& metadata() const { return metadata_; }

    /// @brief The `__metadata__` value of `key`.
    /// @throws rpe::invalid_argument `[rpe.safetensors] missing metadata key '<key>' in <file>`.
    [[nodiscard]] std::string metadata_value(std::string_view key) const {
        const auto it = metadata_.find(std::string(key));
        if (it == metadata_.end())
            throw invalid_argument(rpe::detail::message("safetensors", "missing metadata key '", key, "' in ", name_));
        return it->second;
    }

    /// @brief Directory entry of tensor `name`.
    /// @throws rpe::invalid_argument `[rpe.safetensors] missing tensor '<name>' in <file>`.
    [[nodiscard]] const tensor_info& info(std::string_view name) const {
        const auto it = tensors_.find(name);
        if (it == tensors_.end())
            throw invalid_argument(rpe::detail::message("safetensors", "missing tensor '", name, "' in ", name_));
        return it->second;
    }

    /// @brief Zero-copy view of tensor `name` as T (valid while this object or a copy lives).
    ///
    /// T must match the dtype exactly: `float` F32, `double` F64, `std::int64_t` I64,
    /// `std::int32_t` I32, `std::uint8_t` U8 (also I8, I16, U16, U32, U64).
    /// @throws rpe::invalid_argument `[rpe.safetensors] missing tensor '<name>' in <file>`;
    ///   `[rpe.safetensors] tensor '<name>' in <file> has dtype F64, expected F32`; `... has
    ///   rank 5, rank > 4 cannot be viewed`.
    /// @throws rpe::runtime_error `[rpe.safetensors] tensor '<name>' in <file>: data offset <b>
    ///   is not aligned for F32 ...` when `begin` is not a multiple of `alignof(T)` (use
    ///   to_vector() for such files).
    template <class T>
    [[nodiscard]] tensor_ref<const T> view(std::string_view name) const {
        const tensor_info& ti = checked_info<T>(name);
        if (ti.shape.size() > static_cast<std::size_t>(max_rank))
            throw invalid_argument(rpe::detail::message("safetensors", "tensor '", name, "' in ", name_, " has rank ",
                                                        ti.shape.size(), ", rank > ", max_rank, " cannot be viewed"));
        if (ti.begin % static_cast<std::int64_t>(alignof(T)) != 0)
            throw runtime_error(rpe::detail::message("safetensors", "tensor '", name, "' in ", name_, ": data offset ", ti.begin,
                                                     " is not aligned for ", ti.dtype, " (needs a multiple of ", alignof(T),
                                                     "); use to_vector() to copy it"));
        tensor_ref<const T> r;
        r.data = reinterpret_cast<const T*>(data_.get() + ti.begin);
        r.rank = static_cast<int>(ti.shape.size());
        for (std::size_t i = 0; i < ti.shape.size(); ++i) r.shape[i] = ti.shape[i];
        return r;
    }

    /// @brief view() that also checks the shape.
    /// @throws rpe::invalid_argument as view(), and `[rpe.safetensors] tensor '<name>' in <file>
    ///   has shape (1, 16, 50), expected (1, 8, 50)` when the shape differs.
    template <class T>
    [[nodiscard]] tensor_ref<const T> view(std::string_view name, std::initializer_list<std::int64_t> expected_shape) const {
        const tensor_info& ti = checked_info<T>(name);
        if (!std::equal(ti.shape.begin(), ti.shape.end(), expected_shape.begin(), expected_shape.end()))
            throw invalid_argument(rpe::detail::message("safetensors", "tensor '", name, "' in ", name_, " has shape ",
                                                        rpe::detail::shape_string(ti.shape), ", expected ",
                                                        shape_string(expected_shape)));
        return view<T>(name);
    }

    /// @brief Copy of tensor `name`'s elements (row-major) as T, dtype matched exactly as in
    /// view(); works for any rank and any offset alignment.
    /// @throws rpe::invalid_argument as view() for a missing tensor or another dtype.
    template <class T>
    [[nodiscard]] std::vector<T> to_vector(std::string_view name) const {
        const tensor_info& ti = checked_info<T>(name);
        std::vector<T> out(static_cast<std::size_t>(ti.end - ti.begin) / sizeof(T));
        if (!out.empty()) std::memcpy(out.data(), data_.get() + ti.begin, out.size() * sizeof(T));
        return out;
    }

private:
    std::string name_;
    std::shared_ptr<std::byte> data_;  // 64-byte aligned copy of the data buffer
    std::size_t size_ = 0;             // bytes in data_
    std::map<std::string, tensor_info, std::less<>> tensors_;
    std::vector<std::string> order_;
    std::map<std::string, std::string> metadata_;

    template <class... Parts>
    [[noreturn]] void fail(Parts&&... parts) const {
        throw runtime_error(rpe::detail::message("safetensors", name_, ": ", std::forward<Parts>(parts)...));
    }

    template <class T>
    const tensor_info& checked_info(std::string_view name) const {
        constexpr std::string_view want = detail::safetensors_dtype_of<T>();
        static_assert(!want.empty(), "safetensors_file: T has no safetensors dtype that can be read in place");
        const tensor_info& ti = info(name);
        if (ti.dtype != want)
            throw invalid_argument(rpe::detail::message("safetensors", "tensor '", name, "' in ", name_, " has dtype ", ti.dtype,
                                                        ", expected ", want));
        return ti;
    }

    std::uint64_t check_header_length(const unsigned char (&len)[8], std::uint64_t file_size) const {
        std::uint64_t n = 0;
        for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(len[i]) << (8 * i);
        if (n > max_header_size) fail("header length ", n, " exceeds the 100 MB limit (corrupt file?)");
        if (n > file_size - 8) fail("header length ", n, " is larger than the ", file_size - 8, " bytes after it");
        return n;
    }

    void parse_header(const std::string& header) {
        using json = nlohmann::json;
        // First pass, SAX (linear time): reject duplicate keys in every object (tensor names, an
        // entry's "dtype", metadata keys: nlohmann::json would keep the last one silently) and
        // absurd nesting (a valid header nests 3 levels: object -> entry -> shape array). A DOM
        // parse with a callback would cost quadratic time on headers with many tensors.
        struct key_checker : nlohmann::json_sax<json> {
            const safetensors_file* self;
            std::vector<std::unordered_set<std::string>> open_objects;  // keys seen in each enclosing object
            int depth = 0;
            explicit key_checker(const safetensors_file* s) : self(s) {}
            bool null() override { return true; }
            bool boolean(bool) override { return true; }
            bool number_integer(number_integer_t) override { return true; }
            bool number_unsigned(number_unsigned_t) override { return true; }
            bool number_float(number_float_t, const string_t&) override { return true; }
            bool string(string_t&) override { return true; }
            bool binary(binary_t&) override { return true; }
            bool start_object(std::size_t) override {
                if (++depth > 16) self->fail("header JSON is nested more than 16 levels deep");
                open_objects.emplace_back();
                return true;
            }
            bool key(string_t& k) override {
                if (!open_objects.back().insert(k).second) {
                    if (open_objects.size() == 1) self->fail("key '", k, "' appears twice in the header");
                    self->fail("key '", k, "' appears twice in one object of the header (at nesting depth ", depth, ")");
                }
                return true;
            }
            bool end_object() override {
                --depth;
                open_objects.pop_back();
                return true;
            }
            bool start_array(std::size_t) override {
                if (++depth > 16) self->fail("header JSON is nested more than 16 levels deep");
                return true;
            }
            bool end_array() override {
                --depth;
                return true;
            }
            bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
                self->fail("header is not valid JSON: ", e.what());
            }
        };
        key_checker checker(this);
        json::sax_parse(header.begin(), header.end(), &checker);
        // Second pass: the document itself (plain parse, linear time).
        json j;
        try {
            j = json::parse(header.begin(), header.end());
        } catch (const json::exception& e) {
            fail("header is not valid JSON: ", e.what());
        }
        if (!j.is_object()) fail("header JSON is not an object");

        for (const auto& [key, value] : j.items()) {
            if (key == "__metadata__") {
                if (!value.is_object()) fail("'__metadata__' is not an object");
                for (const auto& [mk, mv] : value.items()) {
                    if (!mv.is_string()) fail("metadata value of '", mk, "' is not a string");
                    metadata_.emplace(mk, mv.get<std::string>());
                }
                continue;
            }
            tensors_.emplace(key, parse_entry(key, value));
        }

        // File order and overlap check: sort by (begin, end, name).
        std::vector<const std::pair<const std::string, tensor_info>*> sorted;
        sorted.reserve(tensors_.size());
        for (const auto& kv : tensors_) sorted.push_back(&kv);
        std::sort(sorted.begin(), sorted.end(), [](const auto* a, const auto* b) {
            if (a->second.begin != b->second.begin) return a->second.begin < b->second.begin;
            if (a->second.end != b->second.end) return a->second.end < b->second.end;
            return a->first < b->first;
        });
        std::int64_t covered = 0;  // end of the non-empty tensors so far
        const std::string* last = nullptr;
        for (const auto* kv : sorted) {
            const tensor_info& ti = kv->second;
            if (ti.end > ti.begin) {
                if (ti.begin < covered)
                    fail("tensors '", *last, "' and '", kv->first, "' overlap (byte ", ti.begin, " < ", covered, ")");
                covered = ti.end;
                last = &kv->first;
            }
            order_.push_back(kv->first);
        }
    }

    tensor_info parse_entry(const std::string& key, const nlohmann::json& v) const {
        if (!v.is_object()) fail("entry '", key, "' is not an object");
        const auto dt = v.find("dtype");
        const auto sh = v.find("shape");
        const auto off = v.find("data_offsets");
        if (dt == v.end()) fail("entry '", key, "' has no 'dtype'");
        if (sh == v.end()) fail("entry '", key, "' has no 'shape'");
        if (off == v.end()) fail("entry '", key, "' has no 'data_offsets'");
        if (!dt->is_string()) fail("entry '", key, "': 'dtype' is not a string");
        if (!sh->is_array()) fail("entry '", key, "': 'shape' is not an array");
        if (!off->is_array()) fail("entry '", key, "': 'data_offsets' is not an array");

        tensor_info ti;
        ti.dtype = dt->get<std::string>();
        const std::size_t item = detail::safetensors_dtype_size(ti.dtype);
        if (item == 0) fail("entry '", key, "': unknown dtype '", ti.dtype, "'");

        // The product of the non-zero extents (times the item size) must fit int64 even when an
        // extent is 0: a (2^62, 2^62, 0) tensor holds nothing but would overflow every size
        // computed from its shape (numpy refuses such shapes too).
        std::uint64_t nonzero = 1;
        bool empty = false;
        constexpr auto int64_max = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
        if (sh->size() > 64) fail("entry '", key, "': 'shape' has ", sh->size(), " extents; expected at most 64");
        for (const auto& e : *sh) {
            if (!e.is_number_integer()) fail("entry '", key, "': 'shape' holds a non-integer");
            if (e.is_number_unsigned()) {
                const auto u = e.get<std::uint64_t>();
                if (u > int64_max) fail("entry '", key, "': extent ", u, " overflows int64");
            } else if (e.get<std::int64_t>() < 0) {
                fail("entry '", key, "': negative extent ", e.get<std::int64_t>());
            }
            const auto d = static_cast<std::uint64_t>(e.get<std::int64_t>());
            if (d != 0 && nonzero > int64_max / item / d)
                fail("entry '", key, "': shape product overflows: ", nonzero, " * ", d, " elements of ", item,
                     " bytes exceed int64 (the product of the non-zero extents must fit, even when an extent is 0)");
            if (d == 0)
                empty = true;
            else
                nonzero *= d;
            ti.shape.push_back(static_cast<std::int64_t>(d));
        }
        const std::uint64_t count = empty ? 0 : nonzero;

        if (off->size() != 2) fail("entry '", key, "': 'data_offsets' does not hold 2 values");
        std::uint64_t be[2];
        for (std::size_t i = 0; i < 2; ++i) {
            const auto& o = (*off)[i];
            if (!o.is_number_integer()) fail("entry '", key, "': 'data_offsets' holds a non-integer");
            if (!o.is_number_unsigned() && o.get<std::int64_t>() < 0)
                fail("entry '", key, "': negative data offset ", o.get<std::int64_t>());
            be[i] = o.get<std::uint64_t>();
        }
        if (be[0] > be[1]) fail("entry '", key, "': data_offsets begin ", be[0], " > end ", be[1]);
        if (be[1] > size_)
            fail("entry '", key, "': data_offsets [", be[0], ", ", be[1], "] exceed the data buffer of ", size_, " bytes");
        if (be[1] - be[0] != count * item)
            fail("entry '", key, "': holds ", be[1] - be[0], " bytes, but shape ", rpe::detail::shape_string(ti.shape), " of ",
                 ti.dtype, " needs ", count * item);
        ti.begin = static_cast<std::int64_t>(be[0]);
        ti.end = static_cast<std::int64_t>(be[1]);
        return ti;
    }
};

}  // namespace rpe::io
