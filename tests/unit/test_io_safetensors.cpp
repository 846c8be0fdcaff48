// Tests of rpe/io/safetensors.hpp: in-memory files built with nlohmann::json, every error path,
// and (when present) the real digits model.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <rpe/io/safetensors.hpp>

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_io_safetensors {

#ifndef RPE_TEST_DATA_DIR
#error "RPE_TEST_DATA_DIR must be defined (path of tests/data)"
#endif

namespace {

using json = nlohmann::json;
using rpe::io::safetensors_file;

/// Runs `f`, expecting it to throw E; returns what() ("" and a failed check otherwise).
template <class E, class F>
std::string st_error_of(F&& f) {
    try {
        f();
    } catch (const E& e) {
        return e.what();
    } catch (const std::exception& e) {
        FAIL_CHECK("threw another exception type: " << e.what());
        return "";
    }
    FAIL_CHECK("did not throw");
    return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// A safetensors file: 8-byte LE length of `header`, `header`, `data`.
std::vector<std::byte> st_raw(const std::string& header, const std::vector<std::byte>& data) {
    std::vector<std::byte> out(8 + header.size());
    const std::uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
    std::memcpy(out.data() + 8, header.data(), header.size());
    out.insert(out.end(), data.begin(), data.end());
    return out;
}

std::vector<std::byte> st_bytes(const json& header, const std::vector<std::byte>& data) { return st_raw(header.dump(), data); }

template <class T>
void append(std::vector<std::byte>& buf, const std::vector<T>& v) {
    const std::size_t at = buf.size();
    buf.resize(at + v.size() * sizeof(T));
    if (!v.empty()) std::memcpy(buf.data() + at, v.data(), v.size() * sizeof(T));
}

/// Data buffer and header of a small valid file:
///   w   F32 (2, 3)    [0, 24)     1..6
///   idx I64 (4,)      [24, 56)    -2, -1, 0, 5
///   b   F64 (2,)      [56, 72)    0.5, -1.25
///   i32 I32 (1, 1, 3) [72, 84)    7, 8, -9
///   m   U8  (4,)      [84, 88)    0, 1, 1, 0
///   h   F16 (2,)      [88, 92)    (raw)
struct sample {
    json header;
    std::vector<std::byte> data;
    sample() {
        append(data, std::vector<float>{1, 2, 3, 4, 5, 6});
        append(data, std::vector<std::int64_t>{-2, -1, 0, 5});
        append(data, std::vector<double>{0.5, -1.25});
        append(data, std::vector<std::int32_t>{7, 8, -9});
        append(data, std::vector<std::uint8_t>{0, 1, 1, 0});
        append(data, std::vector<std::uint16_t>{0x3c00, 0xc000});
        header = json::parse(R"({
            "w":   {"dtype": "F32", "shape": [2, 3],    "data_offsets": [0, 24]},
            "idx": {"dtype": "I64", "shape": [4],       "data_offsets": [24, 56]},
            "b":   {"dtype": "F64", "shape": [2],       "data_offsets": [56, 72]},
            "i32": {"dtype": "I32", "shape": [1, 1, 3], "data_offsets": [72, 84]},
            "m":   {"dtype": "U8",  "shape": [4],       "data_offsets": [84, 88]},
            "h":   {"dtype": "F16", "shape": [2],       "data_offsets": [88, 92]},
            "__metadata__": {"rpe_method": "product", "format": "pt"}
        })");
    }
    [[nodiscard]] std::vector<std::byte> bytes() const { return st_bytes(header, data); }
};

std::string st_err(const std::vector<std::byte>& file) {
    return st_error_of<rpe::runtime_error>([&] { (void)safetensors_file::parse(file, "bad.safetensors"); });
}
std::string st_err(const json& header, const std::vector<std::byte>& data) { return st_err(st_bytes(header, data)); }

/// A fresh path in the temp folder (random suffix: ctest may run test cases in parallel).
std::string temp_path(const std::string& stem) {
    std::random_device rd;
    const auto tag = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
    return (std::filesystem::temp_directory_path() /
            ("rpe_test_io_safetensors_" + stem + "_" + std::to_string(tag) + ".safetensors"))
        .string();
}

}  // namespace

TEST_CASE("safetensors: directory, metadata and values of an in-memory file") {
    const sample s;
    const auto f = safetensors_file::parse(s.bytes(), "mem.safetensors");
    CHECK(f.file_name() == "mem.safetensors");
    CHECK(f.size() == 6);
    CHECK(f.data_size() == 92);
    CHECK(f.names() == std::vector<std::string>{"w", "idx", "b", "i32", "m", "h"});  // by data offset
    CHECK(f.contains("w"));
    CHECK(f.contains("h"));
    CHECK_FALSE(f.contains("__metadata__"));
    CHECK_FALSE(f.contains("x"));
    CHECK(f.metadata().size() == 2);
    CHECK(f.metadata_value("rpe_method") == "product");
    CHECK(f.metadata_value("format") == "pt");

    const auto& wi = f.info("w");
    CHECK(wi.dtype == "F32");
    CHECK(wi.shape == std::vector<std::int64_t>{2, 3});
    CHECK(wi.begin == 0);
    CHECK(wi.end == 24);
    CHECK(f.info("h").dtype == "F16");
    CHECK(f.info("h").begin == 88);

    const auto w = f.view<float>("w");
    CHECK(w.rank == 2);
    CHECK(w.has_shape({2, 3}));
    CHECK(w.size() == 6);
    CHECK(w.data[0] == 1.0f);
    CHECK(w.data[5] == 6.0f);
    CHECK(reinterpret_cast<std::uintptr_t>(w.data) % 64 == 0);  // data section starts 64-byte aligned

    const auto w2 = f.view<float>("w", {2, 3});
    CHECK(w2.data == w.data);

    const auto idx = f.view<std::int64_t>("idx", {4});
    CHECK(idx.data[0] == -2);
    CHECK(idx.data[3] == 5);
    CHECK(reinterpret_cast<std::uintptr_t>(idx.data) % 8 == 0);
    CHECK(f.to_vector<std::int64_t>("idx") == std::vector<std::int64_t>{-2, -1, 0, 5});

    const auto b = f.view<double>("b", {2});
    CHECK(b.data[0] == 0.5);
    CHECK(b.data[1] == -1.25);
    const auto i32 = f.view<std::int32_t>("i32", {1, 1, 3});
    CHECK(i32.rank == 3);
    CHECK(i32.data[2] == -9);
    CHECK(f.to_vector<std::uint8_t>("m") == std::vector<std::uint8_t>{0, 1, 1, 0});
    CHECK(f.view<std::uint8_t>("m").data[1] == 1);
    CHECK(f.to_vector<float>("w") == std::vector<float>{1, 2, 3, 4, 5, 6});
}

TEST_CASE("safetensors: names follow data offsets, not JSON or alphabetical order") {
    std::vector<std::byte> data;
    append(data, std::vector<float>{10, 20, 30});
    const json h = {{"zeta", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4}}}},
                    {"alpha", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {4, 12}}}},
                    {"empty", {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {12, 12}}}},
                    {"scalar_at_0", {{"dtype", "U8"}, {"shape", json::array()}, {"data_offsets", {0, 0}}}}};
    // scalar_at_0 claims 0 bytes but a scalar needs 1: rejected below; without it the file is fine.
    json ok = h;
    ok.erase("scalar_at_0");
    const auto f = safetensors_file::parse(st_bytes(ok, data), "order.safetensors");
    CHECK(f.names() == std::vector<std::string>{"zeta", "alpha", "empty"});
    CHECK(f.to_vector<float>("alpha") == std::vector<float>{20, 30});
    CHECK(f.view<float>("zeta", {1}).data[0] == 10.0f);
    const auto e = f.view<float>("empty", {0});
    CHECK(e.size() == 0);
    CHECK(f.to_vector<float>("empty").empty());
    CHECK(f.metadata().empty());
    CHECK(has(st_err(h, data), "entry 'scalar_at_0': holds 0 bytes, but shape () of U8 needs 1"));
}

TEST_CASE("safetensors: scalar (rank 0) tensors and a header padded with spaces") {
    std::vector<std::byte> data;
    append(data, std::vector<double>{3.25});
    const json h = {{"s", {{"dtype", "F64"}, {"shape", json::array()}, {"data_offsets", {0, 8}}}}};
    std::string text = h.dump();
    text.append(8 - (8 + text.size()) % 8, ' ');  // writers pad the header to 8 bytes with spaces
    const auto f = safetensors_file::parse(st_raw(text, data), "scalar.safetensors");
    const auto v = f.view<double>("s", {});
    CHECK(v.rank == 0);
    CHECK(v.size() == 1);
    CHECK(v.data[0] == 3.25);
}

TEST_CASE("safetensors: lookup and type errors are invalid_argument with exact messages") {
    const auto f = safetensors_file::parse(sample().bytes(), "mem.safetensors");
    CHECK(st_error_of<rpe::invalid_argument>([&] { (void)f.info("x"); }) ==
          "[rpe.safetensors] missing tensor 'x' in mem.safetensors");
    CHECK(st_error_of<rpe::invalid_argument>([&] { (void)f.view<float>("x"); }) ==
          "[rpe.safetensors] missing tensor 'x' in mem.safetensors");
    CHECK(st_error_of<rpe::invalid_argument>([&] { (void)f.to_vector<float>("x"); }) ==
          "[rpe.safetensors] missing tensor 'x' in mem.safetensors");
    CHECK(st_error_of<rpe::invalid_argument>([&] { (void)f.metadata_value("rpe_mode"); }) ==
          "[rpe.safetensors] missing metadata key 'rpe_mode' in mem.safetensors");
    CHECK(st_error_of<rpe::invalid_argument>([&] { (void)f.view<double>("w"); }) ==
          "[rpe.safetensors] tensor 'w' in mem.safetensors has dtype F32, expected F64");
    CHECK(st_error_of<rpe::invalid_argument>([&] { (void)f.view<std::int32_t>("idx"); }) ==
          "[rpe.safetensors] tensor 'idx' in mem.safetensors has dtype I64, expected I32");
    CHECK(st_error_of<rpe::invalid_argument>([&] { (void)f.to_vector<std::int8_t>("m"); }) ==
          "[rpe.safetensors] tensor 'm' in mem.safetensors has dtype U8, expected I8");
    CHECK(st_error_of<rpe::invalid_argument>([&] { (void)f.view<std::uint16_t>("h"); }) ==
          "[rpe.safetensors] tensor 'h' in mem.safetensors has dtype F16, expected U16");
    CHECK(st_error_of<rpe::invalid_argument>([&] {
              (void)f.view<float>("w", {3, 2});
          }) == "[rpe.safetensors] tensor 'w' in mem.safetensors has shape (2, 3), expected (3, 2)");
    CHECK(st_error_of<rpe::invalid_argument>([&] { (void)f.view<float>("w", {6}); }) ==
          "[rpe.safetensors] tensor 'w' in mem.safetensors has shape (2, 3), expected (6,)");
    CHECK(st_error_of<rpe::invalid_argument>([&] {
              (void)f.view<std::int64_t>("idx", {1, 4});
          }) == "[rpe.safetensors] tensor 'idx' in mem.safetensors has shape (4,), expected (1, 4)");
    // dtype is checked before shape
    CHECK(has(st_error_of<rpe::invalid_argument>([&] { (void)f.view<double>("w", {3, 2}); }), "expected F64"));
}

TEST_CASE("safetensors: a default-constructed file is empty") {
    const safetensors_file f;
    CHECK(f.size() == 0);
    CHECK(f.data_size() == 0);
    CHECK(f.names().empty());
    CHECK(f.metadata().empty());
    CHECK_FALSE(f.contains("w"));
    CHECK_THROWS_AS((void)f.view<float>("w"), rpe::invalid_argument);
    CHECK_THROWS_AS((void)f.metadata_value("k"), rpe::invalid_argument);
}

TEST_CASE("safetensors: rank > 4 cannot be viewed but can be copied") {
    std::vector<std::byte> data;
    append(data, std::vector<float>{1, 2});
    const json h = {{"r5", {{"dtype", "F32"}, {"shape", {1, 1, 2, 1, 1}}, {"data_offsets", {0, 8}}}}};
    const auto f = safetensors_file::parse(st_bytes(h, data), "r5.safetensors");
    const std::string e = st_error_of<rpe::invalid_argument>([&] { (void)f.view<float>("r5"); });
    CHECK(e == "[rpe.safetensors] tensor 'r5' in r5.safetensors has rank 5, rank > 4 cannot be viewed");
    CHECK_THROWS_AS((void)f.view<float>("r5", {1, 1, 2, 1, 1}), rpe::invalid_argument);
    CHECK(f.to_vector<float>("r5") == std::vector<float>{1, 2});
}

TEST_CASE("safetensors: a misaligned offset is an error for view, not UB; to_vector still copies") {
    std::vector<std::byte> data;
    append(data, std::vector<std::uint8_t>{9, 9});
    append(data, std::vector<float>{1.5f});
    append(data, std::vector<std::uint8_t>{0, 0, 0, 0, 0, 0});
    append(data, std::vector<double>{-2.0});
    const json h = {{"pad", {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {0, 2}}}},
                    {"f", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {2, 6}}}},
                    {"d", {{"dtype", "F64"}, {"shape", {1}}, {"data_offsets", {12, 20}}}}};
    const auto f = safetensors_file::parse(st_bytes(h, data), "mis.safetensors");
    const std::string e = st_error_of<rpe::runtime_error>([&] { (void)f.view<float>("f"); });
    CHECK(e ==
          "[rpe.safetensors] tensor 'f' in mis.safetensors: data offset 2 is not aligned for F32 (needs a "
          "multiple of 4); use to_vector() to copy it");
    CHECK(f.to_vector<float>("f") == std::vector<float>{1.5f});
    CHECK(has(st_error_of<rpe::runtime_error>([&] { (void)f.view<double>("d"); }),
              "data offset 12 is not aligned for F64 (needs a multiple of 8)"));
    CHECK(f.to_vector<double>("d") == std::vector<double>{-2.0});
    CHECK(f.view<std::uint8_t>("pad").data[1] == 9);
    CHECK(f.names() == std::vector<std::string>{"pad", "f", "d"});  // the gap [6, 12) is allowed
}

TEST_CASE("safetensors: load from disk and copies share the buffer") {
    const std::string path = temp_path("load");
    {
        const auto bytes = sample().bytes();
        std::ofstream out(path, std::ios::binary);
        out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    }
    rpe::tensor_ref<const float> w;
    {
        const auto f = safetensors_file::load(path);
        CHECK(f.file_name() == path);
        CHECK(f.names().size() == 6);
        CHECK(f.metadata_value("rpe_method") == "product");
        auto copy = f;  // NOLINT(performance-unnecessary-copy-initialization)
        w = copy.view<float>("w", {2, 3});
        CHECK(reinterpret_cast<std::uintptr_t>(w.data) % 64 == 0);
        const std::string e = st_error_of<rpe::invalid_argument>([&] { (void)f.info("nope"); });
        CHECK(e == "[rpe.safetensors] missing tensor 'nope' in " + path);
        const auto moved = std::move(copy);
        CHECK(moved.view<float>("w").data == w.data);
        CHECK(moved.view<float>("w").data[4] == 5.0f);
    }
    std::filesystem::remove(path);

    const std::string e =
        st_error_of<rpe::runtime_error>([] { (void)safetensors_file::load("/nonexistent/dir/model.safetensors"); });
    CHECK(e == "[rpe.safetensors] /nonexistent/dir/model.safetensors: cannot open file");

    // malformed files are rejected by load() as by parse()
    const std::string short_path = temp_path("short");
    {
        std::ofstream out(short_path, std::ios::binary);
        out << "abc";
    }
    CHECK(st_error_of<rpe::runtime_error>([&] { (void)safetensors_file::load(short_path); }) ==
          "[rpe.safetensors] " + short_path + ": file is shorter than 8 bytes (3 bytes)");
    {
        std::ofstream out(short_path, std::ios::binary);
        const auto bytes = st_raw("{\"a\": 1", {});
        out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    }
    CHECK(has(st_error_of<rpe::runtime_error>([&] { (void)safetensors_file::load(short_path); }), "header is not valid JSON"));
    {
        std::ofstream out(short_path, std::ios::binary);
        const auto bytes = st_raw("{}", {});
        out.write(reinterpret_cast<const char*>(bytes.data()), 9);  // header cut
    }
    CHECK(has(st_error_of<rpe::runtime_error>([&] { (void)safetensors_file::load(short_path); }),
              "header length 2 is larger than the 1 bytes after it"));
    std::filesystem::remove(short_path);
}

TEST_CASE("safetensors: malformed files are runtime_error with the file name") {
    const sample s;
    REQUIRE_NOTHROW((void)safetensors_file::parse(s.bytes(), "ok.safetensors"));
    auto with = [&](const std::string& name, const json& entry) {
        json h = s.header;
        h[name] = entry;
        return st_err(h, s.data);
    };
    auto accepts = [&](const std::string& name, const json& entry) {
        json h = s.header;
        h[name] = entry;
        const auto f = safetensors_file::parse(st_bytes(h, s.data), "ok.safetensors");
        return f.contains(name) && f.size() == 7;
    };

    SUBCASE("shorter than 8 bytes") {
        CHECK(st_err(std::vector<std::byte>{}) == "[rpe.safetensors] bad.safetensors: file is shorter than 8 bytes (0 bytes)");
        CHECK(has(st_err(std::vector<std::byte>(7)), "file is shorter than 8 bytes (7 bytes)"));
    }
    SUBCASE("header length larger than the file, or absurd") {
        auto f = s.bytes();
        f[0] = static_cast<std::byte>(std::to_integer<int>(f[0]) + 100);
        CHECK(has(st_err(f), "bad.safetensors: header length"));
        CHECK(has(st_err(f), "is larger than the"));
        auto g = s.bytes();
        g[4] = std::byte{1};  // 2^32 + n
        CHECK(has(st_err(g), "exceeds the 100 MB limit"));
        std::vector<std::byte> h(8, std::byte{0xff});
        CHECK(has(st_err(h), "header length 18446744073709551615 exceeds the 100 MB limit"));
        auto k = st_raw("", {});
        k[0] = std::byte{1};  // length 1, nothing follows
        CHECK(st_err(k) == "[rpe.safetensors] bad.safetensors: header length 1 is larger than the 0 bytes after it");
    }
    SUBCASE("invalid JSON") {
        CHECK(has(st_err(st_raw("{\"a\": ", {})), "bad.safetensors: header is not valid JSON"));
        CHECK(has(st_err(st_raw("", {})), "header is not valid JSON"));
        CHECK(has(st_err(st_raw("{} trailing", {})), "header is not valid JSON"));
        CHECK(has(st_err(st_raw("{'a': 1}", {})), "header is not valid JSON"));
        CHECK(has(st_err(st_raw("{\"\xff\": 1}", {})), "header is not valid JSON"));  // invalid UTF-8
        CHECK(has(st_err(st_raw(std::string("{\"a\0\": 1}", 9), {})), "header is not valid JSON"));
        CHECK(has(st_err(st_raw("[1, 2]", {})), "header JSON is not an object"));
        CHECK(has(st_err(st_raw("42", {})), "header JSON is not an object"));
        CHECK(has(st_err(st_raw(std::string(100000, '[') + std::string(100000, ']'), {})), "nested more than 16"));
        CHECK(has(st_err(st_raw("{\"a\": {\"dtype\": \"U8\", \"shape\": [], \"data_offsets\": [0, 1]}, "
                                "\"a\": {\"dtype\": \"U8\", \"shape\": [], \"data_offsets\": [1, 2]}}",
                                std::vector<std::byte>(2))),
                  "key 'a' appears twice in the header"));
        // a key repeated inside an entry or in the metadata (the JSON parser alone keeps the last)
        CHECK(st_err(st_raw("{\"a\": {\"dtype\": \"U8\", \"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 1]}}",
                            std::vector<std::byte>(1))) ==
              "[rpe.safetensors] bad.safetensors: key 'dtype' appears twice in one object of the header (at nesting depth 2)");
        CHECK(has(st_err(st_raw("{\"a\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1], \"shape\": [1]}}",
                                std::vector<std::byte>(1))),
                  "key 'shape' appears twice in one object"));
        CHECK(has(st_err(st_raw("{\"__metadata__\": {\"format\": \"pt\", \"format\": \"np\"}}", {})),
                  "key 'format' appears twice in one object"));
        // the same key in two different objects is fine
        CHECK_NOTHROW(
            rpe::io::safetensors_file::parse(st_raw("{\"a\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1]}, "
                                                    "\"b\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [1, 2]}}",
                                                    std::vector<std::byte>(2)),
                                             "ok.safetensors"));
    }
    SUBCASE("entry missing a field or of the wrong JSON type") {
        CHECK(with("x", 5) == "[rpe.safetensors] bad.safetensors: entry 'x' is not an object");
        CHECK(has(with("x", json::array()), "entry 'x' is not an object"));
        CHECK(has(with("x", {{"shape", {1}}, {"data_offsets", {92, 92}}}), "entry 'x' has no 'dtype'"));
        CHECK(has(with("x", {{"dtype", "U8"}, {"data_offsets", {92, 92}}}), "entry 'x' has no 'shape'"));
        CHECK(has(with("x", {{"dtype", "U8"}, {"shape", {0}}}), "entry 'x' has no 'data_offsets'"));
        CHECK(has(with("x", {{"dtype", 4}, {"shape", {0}}, {"data_offsets", {92, 92}}}), "'dtype' is not a string"));
        CHECK(has(with("x", {{"dtype", "U8"}, {"shape", "0"}, {"data_offsets", {92, 92}}}), "'shape' is not an array"));
        CHECK(has(with("x", {{"dtype", "U8"}, {"shape", {0}}, {"data_offsets", {{"a", 1}}}}), "'data_offsets' is not an array"));
        CHECK(has(with("x", {{"dtype", "U8"}, {"shape", {1.0}}, {"data_offsets", {91, 92}}}), "'shape' holds a non-integer"));
        CHECK(has(with("x", {{"dtype", "U8"}, {"shape", {"1"}}, {"data_offsets", {91, 92}}}), "'shape' holds a non-integer"));
        CHECK(has(with("x", {{"dtype", "U8"}, {"shape", {0}}, {"data_offsets", {92}}}), "'data_offsets' does not hold 2 values"));
        CHECK(has(with("x", {{"dtype", "U8"}, {"shape", {0}}, {"data_offsets", {92, 92, 92}}}),
                  "'data_offsets' does not hold 2 values"));
        CHECK(has(with("x", {{"dtype", "U8"}, {"shape", {1}}, {"data_offsets", {91.0, 92}}}),
                  "'data_offsets' holds a non-integer"));
        CHECK(has(with("x", {{"dtype", "U8"}, {"shape", {1}}, {"data_offsets", {nullptr, 92}}}),
                  "'data_offsets' holds a non-integer"));
    }
    SUBCASE("unknown dtype") {
        CHECK(with("x", {{"dtype", "F128"}, {"shape", {0}}, {"data_offsets", {92, 92}}}) ==
              "[rpe.safetensors] bad.safetensors: entry 'x': unknown dtype 'F128'");
        CHECK(has(with("x", {{"dtype", "f32"}, {"shape", {0}}, {"data_offsets", {92, 92}}}), "unknown dtype 'f32'"));
        CHECK(has(with("x", {{"dtype", ""}, {"shape", {0}}, {"data_offsets", {92, 92}}}), "unknown dtype ''"));
    }
    SUBCASE("negative or overflowing shape") {
        CHECK(with("x", {{"dtype", "U8"}, {"shape", {-1}}, {"data_offsets", {92, 92}}}) ==
              "[rpe.safetensors] bad.safetensors: entry 'x': negative extent -1");
        CHECK(
            has(with("x", {{"dtype", "U8"}, {"shape", {std::numeric_limits<std::uint64_t>::max()}}, {"data_offsets", {92, 92}}}),
                "extent 18446744073709551615 overflows int64"));
        CHECK(has(with("x", {{"dtype", "F32"}, {"shape", {4294967296LL, 4294967296LL}}, {"data_offsets", {92, 92}}}),
                  "entry 'x': shape product overflows"));
        CHECK(
            has(with("x", {{"dtype", "F64"}, {"shape", {std::numeric_limits<std::int64_t>::max()}}, {"data_offsets", {92, 92}}}),
                "shape product overflows"));
        // a zero extent keeps the element count 0, but the non-zero extents must still fit (issue 16)
        CHECK(has(
            with("x", {{"dtype", "F64"}, {"shape", {0, std::numeric_limits<std::int64_t>::max()}}, {"data_offsets", {92, 92}}}),
            "entry 'x': shape product overflows: 1 * 9223372036854775807"));
        CHECK(accepts("x", {{"dtype", "F64"}, {"shape", {0, 2147483648LL}}, {"data_offsets", {92, 92}}}));
    }
    SUBCASE("data_offsets out of the buffer, reversed or negative") {
        CHECK(with("x", {{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {92, 96}}}) ==
              "[rpe.safetensors] bad.safetensors: entry 'x': data_offsets [92, 96] exceed the data buffer of 92 bytes");
        CHECK(has(with("x", {{"dtype", "U8"}, {"shape", {0}}, {"data_offsets", {93, 93}}}), "exceed the data buffer"));
        CHECK(has(with("x", {{"dtype", "U8"},
                             {"shape", {1}},
                             {"data_offsets",
                              {std::numeric_limits<std::uint64_t>::max() - 1, std::numeric_limits<std::uint64_t>::max()}}}),
                  "exceed the data buffer"));
        CHECK(has(with("x", {{"dtype", "U8"}, {"shape", {1}}, {"data_offsets", {92, 91}}}),
                  "entry 'x': data_offsets begin 92 > end 91"));
        CHECK(has(with("x", {{"dtype", "U8"}, {"shape", {1}}, {"data_offsets", {-1, 0}}}), "negative data offset -1"));
    }
    SUBCASE("byte size differs from shape product times dtype size") {
        json h = s.header;
        h["w"]["shape"] = {2, 2};
        CHECK(st_err(h, s.data) ==
              "[rpe.safetensors] bad.safetensors: entry 'w': holds 24 bytes, but shape (2, 2) of F32 needs 16");
        h = s.header;
        h["idx"]["dtype"] = "I32";
        CHECK(has(st_err(h, s.data), "entry 'idx': holds 32 bytes, but shape (4,) of I32 needs 16"));
    }
    SUBCASE("overlapping tensors") {
        CHECK(with("x", {{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {20, 24}}}) ==
              "[rpe.safetensors] bad.safetensors: tensors 'w' and 'x' overlap (byte 20 < 24)");
        CHECK(has(with("x", {{"dtype", "F32"}, {"shape", {6}}, {"data_offsets", {0, 24}}}), "overlap"));  // same range
        CHECK(has(with("x", {{"dtype", "U8"}, {"shape", {1}}, {"data_offsets", {30, 31}}}), "tensors 'idx' and 'x' overlap"));
        // empty tensors overlap nothing
        CHECK(accepts("x", {{"dtype", "U8"}, {"shape", {0}}, {"data_offsets", {30, 30}}}));
        CHECK(accepts("x", {{"dtype", "U8"}, {"shape", {0}}, {"data_offsets", {92, 92}}}));
    }
    SUBCASE("metadata values not strings") {
        json h = s.header;
        h["__metadata__"]["depth"] = 4;
        CHECK(st_err(h, s.data) == "[rpe.safetensors] bad.safetensors: metadata value of 'depth' is not a string");
        h["__metadata__"] = {{"nested", {{"a", "b"}}}};
        CHECK(has(st_err(h, s.data), "metadata value of 'nested' is not a string"));
        h["__metadata__"] = "format=pt";
        CHECK(has(st_err(h, s.data), "'__metadata__' is not an object"));
    }
}

TEST_CASE("safetensors: truncations and byte changes of a valid file never crash") {
    const auto good = sample().bytes();
    int parsed = 0, rejected = 0;
    for (std::size_t n = 0; n < good.size(); ++n) {
        const std::vector<std::byte> cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
        try {
            (void)safetensors_file::parse(cut, "cut.safetensors");
            ++parsed;
        } catch (const rpe::runtime_error&) {
            ++rejected;
        }
    }
    CHECK(parsed == 0);  // every cut loses header bytes or the data of "h"
    CHECK(rejected == static_cast<int>(good.size()));

    parsed = rejected = 0;
    const std::size_t header_end = good.size() - sample().data.size();
    for (std::size_t i = 0; i < header_end; ++i) {
        for (int c : {0x00, 0x20, 0x22, 0x2c, 0x30, 0x31, 0x39, 0x5b, 0x5d, 0x7b, 0x7d, 0xc3, 0xff}) {
            auto f = good;
            f[i] = static_cast<std::byte>(c);
            try {
                const auto st = safetensors_file::parse(f, "flip.safetensors");
                for (const auto& name : st.names()) {
                    const auto& ti = st.info(name);
                    REQUIRE(ti.begin <= ti.end);
                    REQUIRE(static_cast<std::size_t>(ti.end) <= st.data_size());
                }
                ++parsed;
            } catch (const rpe::runtime_error&) {
                ++rejected;
            }
        }
    }
    CHECK(parsed > 0);  // e.g. a digit of a value in __metadata__
    CHECK(rejected > 0);
}

TEST_CASE("safetensors: the digits model, when examples/data holds it") {
    const std::string path = std::string(RPE_TEST_DATA_DIR) + "/../../examples/data/digits/deit_irpe_digits_a.safetensors";
    if (!std::filesystem::exists(path)) {
        MESSAGE("skipped: " << path << " is not present");
        return;
    }
    const auto f = safetensors_file::load(path);
    CHECK(f.size() == 68);
    CHECK(f.metadata_value("rpe_method") == "product");
    CHECK(f.metadata_value("rpe_num_buckets") == "50");
    const auto& ti = f.info("blocks.0.attn.rpe_k.lookup_table_weight");
    CHECK(ti.dtype == "F32");
    CHECK(ti.shape == std::vector<std::int64_t>{1, 16, 50});
    const auto t = f.view<float>("blocks.0.attn.rpe_k.lookup_table_weight", {1, 16, 50});
    CHECK(t.size() == 800);
    CHECK(reinterpret_cast<std::uintptr_t>(t.data) % 4 == 0);
    const auto names = f.names();
    CHECK(names.front() == "cls_token");
    CHECK(names[1] == "pos_embed");
    CHECK(f.view<float>("pos_embed", {1, 65, 64}).size() == 65 * 64);
    CHECK(f.view<float>("blocks.0.attn.qkv.weight", {192, 64}).rank == 2);
}

}  // namespace rpe_unit_io_safetensors
