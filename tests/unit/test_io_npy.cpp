// Tests of rpe/io/npy.hpp: golden .npy files, conversions, round trips and every error path.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include <rpe/io/npy.hpp>

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_io_npy {

#ifndef RPE_TEST_DATA_DIR
#error "RPE_TEST_DATA_DIR must be defined (path of tests/data)"
#endif

namespace {

const std::string golden = std::string(RPE_TEST_DATA_DIR) + "/golden";

/// Runs `f`, expecting it to throw E; returns what() ("" and a failed check otherwise).
template <class E, class F>
std::string npy_error_of(F&& f) {
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

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::vector<std::byte> to_bytes(const std::string& s) {
    std::vector<std::byte> b(s.size());
    std::memcpy(b.data(), s.data(), s.size());
    return b;
}

/// A .npy file of version major.0 with header dict `dict` (padded to 64 bytes, '\n' ended),
/// followed by `data`.
std::vector<std::byte> make_npy(const std::string& dict, const std::vector<std::byte>& data, int major = 1) {
    const std::size_t len_bytes = major == 1 ? 2 : 4;
    std::string header = dict;
    const std::size_t unpadded = 8 + len_bytes + header.size() + 1;
    header.append((64 - unpadded % 64) % 64, ' ');
    header += '\n';
    std::string prefix = std::string("\x93NUMPY", 6) + static_cast<char>(major) + '\0';
    for (std::size_t i = 0; i < len_bytes; ++i) prefix += static_cast<char>((header.size() >> (8 * i)) & 0xff);
    std::vector<std::byte> out = to_bytes(prefix + header);
    out.insert(out.end(), data.begin(), data.end());
    return out;
}

template <class T>
std::vector<std::byte> raw(const std::vector<T>& v) {
    std::vector<std::byte> b(v.size() * sizeof(T));
    if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
    return b;
}

std::vector<std::byte> read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<std::byte> b(c.size());
    if (!c.empty()) std::memcpy(b.data(), c.data(), c.size());
    return b;
}

/// A fresh path in the temp folder (random suffix: ctest may run test cases in parallel).
std::string temp_path(const std::string& stem) {
    std::random_device rd;
    const auto tag = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
    return (std::filesystem::temp_directory_path() / ("rpe_test_io_npy_" + stem + "_" + std::to_string(tag) + ".npy")).string();
}

}  // namespace

TEST_CASE("npy: golden offsets.npy is int64 -2000..2000") {
    const auto a = rpe::io::load_npy(golden + "/index/r1.9/offsets.npy");
    CHECK(a.dtype == "<i8");
    REQUIRE(a.shape == std::vector<std::int64_t>{4001});
    CHECK(a.size() == 4001);
    CHECK(a.rank() == 1);
    CHECK(a.itemsize() == 8);
    CHECK_FALSE(a.is_float());
    CHECK(a.bytes.size() == 4001 * 8);
    const auto v = a.as<std::int64_t>();
    REQUIRE(v.size() == 4001);
    for (std::size_t i = 0; i < v.size(); ++i) REQUIRE(v[i] == static_cast<std::int64_t>(i) - 2000);
    const auto v32 = a.to<std::int32_t>();
    CHECK(v32.front() == -2000);
    CHECK(v32[2000] == 0);
    CHECK(v32.back() == 2000);
    const auto vi16 = a.to<std::int16_t>();
    CHECK(vi16[1] == -1999);
    const auto vd = a.to<double>();
    CHECK(vd.front() == -2000.0);
    CHECK(vd.back() == 2000.0);
    const auto vf = a.to<float>();
    CHECK(vf[2001] == 1.0f);

    // -2000 does not fit int8 or any unsigned type.
    const std::string e8 = npy_error_of<rpe::out_of_range>([&] { (void)a.to<std::int8_t>(); });
    CHECK(contains(e8, "[rpe.npy] "));
    CHECK(contains(e8, "offsets.npy"));
    CHECK(contains(e8, "element 0 (value -2000)"));
    CHECK(contains(e8, "does not fit int8"));
    CHECK_THROWS_AS((void)a.to<std::uint64_t>(), rpe::out_of_range);
    CHECK_THROWS_AS((void)a.to<std::uint8_t>(), rpe::out_of_range);
    CHECK_THROWS_AS((void)a.to<bool>(), rpe::out_of_range);

    const std::string ed = npy_error_of<rpe::invalid_argument>([&] { (void)a.as<std::int32_t>(); });
    CHECK(contains(ed, "[rpe.npy] "));
    CHECK(contains(ed, "expected dtype <i4 (int32), got <i8"));
}

TEST_CASE("npy: golden index.npy (int32) holds the piecewise index of ratio 1.9") {
    const auto a = rpe::io::load_npy(golden + "/index/r1.9/index.npy");
    CHECK(a.dtype == "<i4");
    REQUIRE(a.shape == std::vector<std::int64_t>{4001});
    const auto v = a.as<std::int32_t>();
    CHECK(v[0] == -3);     // x = -2000 saturates at -floor(3.8)
    CHECK(v[1998] == -2);  // x = -2
    CHECK(v[1999] == -1);  // x = -1
    CHECK(v[2000] == 0);   // x = 0
    CHECK(v[2001] == 1);   // x = 1
    CHECK(v[2003] == 2);   // x = 3
    CHECK(v[4000] == 3);   // x = 2000
    const auto v64 = a.to<std::int64_t>();
    const auto vu = a.to<std::int8_t>();  // all in [-3, 3]
    for (std::size_t i = 0; i < v.size(); ++i) {
        REQUIRE(v64[i] == v[i]);
        REQUIRE(vu[i] == v[i]);
    }
    CHECK_THROWS_AS((void)a.to<std::uint32_t>(), rpe::out_of_range);  // negative ids
    CHECK_THROWS_AS((void)a.as<std::int64_t>(), rpe::invalid_argument);
    CHECK_THROWS_AS((void)a.as<float>(), rpe::invalid_argument);
}

TEST_CASE("npy: golden float_inputs.npy (float32) holds 0..2000 and refuses integer reads") {
    const auto a = rpe::io::load_npy(golden + "/index/r1.9/float_inputs.npy");
    CHECK(a.dtype == "<f4");
    CHECK(a.is_float());
    REQUIRE(a.shape == std::vector<std::int64_t>{2001});
    const auto v = a.as<float>();
    for (std::size_t i = 0; i < v.size(); ++i) REQUIRE(v[i] == static_cast<float>(i));
    const auto vd = a.to<double>();
    CHECK(vd[1234] == 1234.0);
    const std::string e = npy_error_of<rpe::invalid_argument>([&] { (void)a.to<std::int32_t>(); });
    CHECK(contains(e, "[rpe.npy] "));
    CHECK(contains(e, "float_inputs.npy"));
    CHECK(contains(e, "dtype <f4 cannot be read as an integer type"));
    CHECK_THROWS_AS((void)a.to<bool>(), rpe::invalid_argument);
    CHECK_THROWS_AS((void)a.to<std::uint8_t>(), rpe::invalid_argument);
    CHECK_THROWS_AS((void)a.as<double>(), rpe::invalid_argument);
}

TEST_CASE("npy: golden key_padding_mask.npy (uint8, shape (2, 35)) marks 15 padded keys in batch 1") {
    const auto a =
        rpe::io::load_npy(golden + "/attention/product_ctx_k_shared_5x7_skip0_r2.0_B2H2D8_masked/key_padding_mask.npy");
    CHECK(a.dtype == "|u1");
    REQUIRE(a.shape == std::vector<std::int64_t>{2, 35});
    const auto m = a.as<std::uint8_t>();
    int row0 = 0, row1 = 0;
    for (int j = 0; j < 35; ++j) {
        REQUIRE(m[static_cast<std::size_t>(j)] <= 1);
        row0 += m[static_cast<std::size_t>(j)];
        row1 += m[static_cast<std::size_t>(35 + j)];
    }
    CHECK(row0 == 0);
    CHECK(row1 == 15);
    // Batch 1 has 2 padded right columns: the last key of the first row (col 6) is padded.
    CHECK(m[35 + 6] == 1);
    CHECK(m[35 + 0] == 0);
    const auto b = a.to<bool>();
    CHECK(b[35 + 6]);
    CHECK_FALSE(b[35]);
    const auto f = a.to<float>();
    CHECK(f[35 + 6] == 1.0f);
}

TEST_CASE("npy: golden float32 and float64 attention outputs agree") {
    const std::string dir = golden + "/attention/product_ctx_k_shared_5x6_skip1_r1.9";
    const auto a32 = rpe::io::load_npy(dir + "/attn.npy");
    const auto a64 = rpe::io::load_npy(dir + "/attn_f64.npy");
    CHECK(a32.dtype == "<f4");
    CHECK(a64.dtype == "<f8");
    REQUIRE(a32.shape == a64.shape);
    REQUIRE(a32.size() > 0);
    const auto x = a32.to<double>();
    const auto y = a64.as<double>();
    const auto yf = a64.to<float>();
    REQUIRE(x.size() == y.size());
    double max_err = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
        max_err = std::max(max_err, std::abs(x[i] - y[i]));
        REQUIRE(yf[i] == static_cast<float>(y[i]));
    }
    CHECK(max_err < 1e-5);
    // attention rows are probabilities: the last axis sums to 1
    const auto L = static_cast<std::size_t>(a64.shape.back());
    double row = 0;
    for (std::size_t j = 0; j < L; ++j) row += y[j];
    CHECK(row == doctest::Approx(1.0).epsilon(1e-12));
}

TEST_CASE("npy: encode_npy writes byte-identical files to numpy's") {
    for (const char* name : {"offsets.npy", "index.npy", "float_inputs.npy"}) {
        CAPTURE(name);
        const std::string path = golden + "/index/r1.9/" + name;
        const auto file = read_file(path);
        const auto a = rpe::io::load_npy(path);
        std::vector<std::byte> enc;
        if (a.dtype == "<i8")
            enc = rpe::io::encode_npy(a.as<std::int64_t>().data(), std::span<const std::int64_t>(a.shape));
        else if (a.dtype == "<i4")
            enc = rpe::io::encode_npy(a.as<std::int32_t>().data(), std::span<const std::int64_t>(a.shape));
        else
            enc = rpe::io::encode_npy(a.as<float>().data(), std::span<const std::int64_t>(a.shape));
        CHECK(enc == file);
    }
    const auto m =
        rpe::io::load_npy(golden + "/attention/product_ctx_k_shared_5x7_skip0_r2.0_B2H2D8_masked/key_padding_mask.npy");
    const auto mv = m.as<std::uint8_t>();
    CHECK(rpe::io::encode_npy(mv.data(), std::span<const std::int64_t>(m.shape)) ==
          read_file(golden + "/attention/product_ctx_k_shared_5x7_skip0_r2.0_B2H2D8_masked/key_padding_mask.npy"));
}

TEST_CASE_TEMPLATE("npy: save_npy / load_npy round trip", T, float, double, std::int32_t, std::int64_t, std::uint8_t,
                   std::uint16_t, std::uint32_t, std::int16_t, std::int8_t, std::uint64_t) {
    using L = std::numeric_limits<T>;
    const std::vector<T> v = {L::lowest(), L::max(), T(0), T(1), T(7), T(42)};
    const std::array<std::int64_t, 2> shape = {2, 3};
    const std::string path = temp_path("roundtrip");
    rpe::io::save_npy(path, v.data(), shape);
    const auto a = rpe::io::load_npy(path);
    std::filesystem::remove(path);
    CHECK(a.dtype == std::string(rpe::io::detail::npy_descr_of<T>()));
    CHECK(a.shape == std::vector<std::int64_t>{2, 3});
    CHECK(a.as<T>() == v);
    CHECK(a.to<T>() == v);
    CHECK(a.is_float() == std::is_floating_point_v<T>);
    CHECK(a.to<double>()[5] == 42.0);
    // the header is padded so that the data start at byte 128 (a multiple of 64)
    const auto enc = rpe::io::encode_npy(v.data(), std::span<const std::int64_t>(shape));
    CHECK(enc.size() == 128 + v.size() * sizeof(T));
    CHECK(std::to_integer<int>(enc[8]) == 118);
    CHECK(std::to_integer<int>(enc[127]) == '\n');
}

TEST_CASE("npy: bool round trip, 0-d and empty arrays, 3-d shape") {
    const bool bv[4] = {true, false, false, true};
    const std::int64_t s4[] = {4};
    const auto b = rpe::io::parse_npy(rpe::io::encode_npy(bv, s4), "b.npy");
    CHECK(b.dtype == "|b1");
    CHECK(b.as<bool>() == std::vector<bool>{true, false, false, true});
    CHECK(b.to<int>() == std::vector<int>{1, 0, 0, 1});
    CHECK(b.to<std::uint8_t>() == std::vector<std::uint8_t>{1, 0, 0, 1});
    CHECK(b.to<float>() == std::vector<float>{1, 0, 0, 1});

    const double scalar = 2.5;
    const auto z = rpe::io::parse_npy(rpe::io::encode_npy(&scalar, std::span<const std::int64_t>()), "z.npy");
    CHECK(z.shape.empty());
    CHECK(z.size() == 1);
    CHECK(z.as<double>() == std::vector<double>{2.5});

    const std::int64_t s0[] = {0, 3};
    const auto e = rpe::io::parse_npy(rpe::io::encode_npy(static_cast<const float*>(nullptr), s0), "e.npy");
    CHECK(e.shape == std::vector<std::int64_t>{0, 3});
    CHECK(e.size() == 0);
    CHECK(e.as<float>().empty());
    CHECK(e.to<double>().empty());
    // float -> integer is refused by dtype, even when there are no elements
    CHECK_THROWS_AS((void)e.to<std::int64_t>(), rpe::invalid_argument);

    const std::vector<std::int32_t> c(24);
    const std::int64_t s3[] = {2, 3, 4};
    const auto enc = rpe::io::encode_npy(c.data(), s3);
    const std::string head(reinterpret_cast<const char*>(enc.data()) + 10, 118);
    CHECK(contains(head, "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3, 4), }"));
    CHECK(rpe::io::parse_npy(enc, "c.npy").shape == std::vector<std::int64_t>{2, 3, 4});
}

TEST_CASE("npy: integer conversions are exact or throw out_of_range") {
    {
        const std::vector<std::uint8_t> v = {0, 127, 128, 255};
        const std::int64_t s[] = {4};
        const auto a = rpe::io::parse_npy(rpe::io::encode_npy(v.data(), s), "u8.npy");
        CHECK(a.to<std::int16_t>() == std::vector<std::int16_t>{0, 127, 128, 255});
        CHECK(a.to<std::uint64_t>() == std::vector<std::uint64_t>{0, 127, 128, 255});
        const std::string e = npy_error_of<rpe::out_of_range>([&] { (void)a.to<std::int8_t>(); });
        CHECK(contains(e, "u8.npy: element 2 (value 128) of dtype |u1 does not fit int8"));
    }
    {
        const std::vector<std::uint64_t> v = {1, std::numeric_limits<std::uint64_t>::max()};
        const std::int64_t s[] = {2};
        const auto a = rpe::io::parse_npy(rpe::io::encode_npy(v.data(), s), "u64.npy");
        const std::string e = npy_error_of<rpe::out_of_range>([&] { (void)a.to<std::int64_t>(); });
        CHECK(contains(e, "element 1 (value 18446744073709551615) of dtype <u8 does not fit int64"));
        CHECK(a.to<double>()[1] == 18446744073709551616.0);
    }
    {
        const std::vector<std::int64_t> v = {std::numeric_limits<std::int64_t>::min(), -1, 0};
        const std::int64_t s[] = {3};
        const auto a = rpe::io::parse_npy(rpe::io::encode_npy(v.data(), s), "i64.npy");
        CHECK_THROWS_AS((void)a.to<std::uint64_t>(), rpe::out_of_range);
        CHECK_THROWS_AS((void)a.to<std::int32_t>(), rpe::out_of_range);
        CHECK(a.to<std::int64_t>() == v);
        CHECK(a.to<double>()[0] == -9223372036854775808.0);
    }
    {
        const std::vector<std::int16_t> v = {-1, 0, 1, 2};
        const std::int64_t s[] = {4};
        const auto a = rpe::io::parse_npy(rpe::io::encode_npy(v.data(), s), "i16.npy");
        const std::string e = npy_error_of<rpe::out_of_range>([&] { (void)a.to<bool>(); });
        CHECK(contains(e, "element 0 (value -1) of dtype <i2 does not fit bool"));
    }
}

TEST_CASE("npy: floating conversions") {
    const std::vector<double> v = {1.5, -0.25, 1e300, -1e300, std::numeric_limits<double>::infinity(), 3.0};
    const std::int64_t s[] = {6};
    const auto a = rpe::io::parse_npy(rpe::io::encode_npy(v.data(), s), "f8.npy");
    const auto f = a.to<float>();
    CHECK(f[0] == 1.5f);
    CHECK(f[1] == -0.25f);
    CHECK(f[2] == std::numeric_limits<float>::infinity());  // beyond float: +inf, no UB
    CHECK(f[3] == -std::numeric_limits<float>::infinity());
    CHECK(f[4] == std::numeric_limits<float>::infinity());
    CHECK(a.to<long double>()[5] == 3.0L);
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const auto n = rpe::io::parse_npy(rpe::io::encode_npy(&nan, std::span<const std::int64_t>()), "nan.npy");
    CHECK(std::isnan(n.to<float>()[0]));
}

TEST_CASE("npy: |b1 bytes other than 0/1 read as true") {
    auto file =
        make_npy("{'descr': '|b1', 'fortran_order': False, 'shape': (3,), }", {std::byte{0}, std::byte{2}, std::byte{255}});
    const auto a = rpe::io::parse_npy(file, "b.npy");
    CHECK(a.as<bool>() == std::vector<bool>{false, true, true});
    CHECK(a.to<int>() == std::vector<int>{0, 1, 1});
}

TEST_CASE("npy: format versions 2.0 and 3.0, double quotes and loose spacing") {
    const std::vector<std::int32_t> v = {5, -6, 7, -8};
    for (int major : {2, 3}) {
        CAPTURE(major);
        const auto a =
            rpe::io::parse_npy(make_npy("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 2), }", raw(v), major), "v.npy");
        CHECK(a.shape == std::vector<std::int64_t>{2, 2});
        CHECK(a.as<std::int32_t>() == v);
    }
    const auto b =
        rpe::io::parse_npy(make_npy("{ \"shape\" : ( 4 , ) ,\"fortran_order\":False,'descr':\"<i4\"}", raw(v)), "w.npy");
    CHECK(b.shape == std::vector<std::int64_t>{4});
    CHECK(b.as<std::int32_t>() == v);
    const auto c = rpe::io::parse_npy(
        make_npy("{'descr': '<i4', 'fortran_order': False, 'shape': ()}", raw(std::vector<std::int32_t>{9})), "c.npy");
    CHECK(c.shape.empty());
    CHECK(c.as<std::int32_t>() == std::vector<std::int32_t>{9});
}

TEST_CASE("npy: errors name the file and the problem") {
    using rpe::io::parse_npy;
    const std::vector<std::byte> four_floats = raw(std::vector<float>{1, 2, 3, 4});
    const std::string ok_dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }";
    REQUIRE(parse_npy(make_npy(ok_dict, four_floats), "ok.npy").as<float>() == std::vector<float>{1, 2, 3, 4});

    auto err = [](const std::vector<std::byte>& file) {
        return npy_error_of<rpe::runtime_error>([&] { (void)parse_npy(file, "bad.npy"); });
    };
    auto dict_err = [&](const std::string& dict) { return err(make_npy(dict, four_floats)); };

    SUBCASE("file cannot be opened") {
        const std::string e = npy_error_of<rpe::runtime_error>([] { (void)rpe::io::load_npy("/nonexistent/dir/missing.npy"); });
        CHECK(e == "[rpe.npy] /nonexistent/dir/missing.npy: cannot open file");
    }
    SUBCASE("bad magic") {
        CHECK(err(to_bytes("PK\x03\x04 not numpy at all")) == "[rpe.npy] bad.npy: bad magic string (not a .npy file)");
        CHECK(contains(err(to_bytes("\x93NUMPZ\x01\x00")), "bad magic"));
        CHECK(contains(err({}), "truncated header"));  // empty file: nothing to compare yet
        CHECK(contains(err(to_bytes("x")), "bad magic"));
    }
    SUBCASE("unsupported version") {
        auto file = make_npy(ok_dict, four_floats);
        file[6] = std::byte{4};
        CHECK(contains(err(file), "bad.npy: unsupported format version 4.0"));
        file[6] = std::byte{1};
        file[7] = std::byte{1};
        CHECK(contains(err(file), "unsupported format version 1.1"));
        file[6] = std::byte{0};
        file[7] = std::byte{0};
        CHECK(contains(err(file), "unsupported format version 0.0"));
    }
    SUBCASE("truncated header") {
        CHECK(contains(err(to_bytes(std::string("\x93NUMPY\x01", 7))), "truncated header"));
        CHECK(contains(err(to_bytes(std::string("\x93NUMPY\x01\x00\x10", 9))), "truncated header"));
        CHECK(contains(err(to_bytes(std::string("\x93NUMPY\x02\x00\x10\x00\x00", 11))), "truncated header"));
        auto file = make_npy(ok_dict, {});  // 128-byte file with header length 118
        REQUIRE(file.size() == 128);
        file.resize(40);
        CHECK(contains(err(file), "bad.npy: truncated header (header length 118, only 30 bytes follow)"));
        auto big = make_npy(ok_dict, four_floats, 2);
        big[8] = std::byte{0xff};
        big[9] = std::byte{0xff};
        big[10] = std::byte{0xff};
        big[11] = std::byte{0xff};
        CHECK(contains(err(big), "bad.npy: header length 4294967295 exceeds the 1048576 bytes this reader accepts"));
    }
    SUBCASE("header not a valid dict literal") {
        CHECK(contains(dict_err("'descr': '<f4', 'fortran_order': False, 'shape': (4,)"), "not a valid dict literal"));
        CHECK(contains(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), "), "not a valid dict literal"));
        CHECK(contains(dict_err("{'descr': '<f4' 'fortran_order': False, 'shape': (4,)}"), "expected ',' or '}'"));
        CHECK(contains(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': [4]}"), "'shape' is not a tuple"));
        CHECK(contains(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (4)}"), "'shape' is not a tuple"));
        CHECK(contains(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (4.0,)}"), "expected ',' or ')'"));
        CHECK(contains(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (a,)}"), "expected an integer"));
        CHECK(contains(dict_err("{'descr': '<f4', 'fortran_order': false, 'shape': (4,)}"), "not True or False"));
        CHECK(contains(dict_err("{'descr': '<f4', 'fortran_order': 0, 'shape': (4,)}"), "not True or False"));
        CHECK(contains(dict_err("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (4,)}"),
                       "structured dtypes are not supported"));
        CHECK(contains(dict_err("{'descr': '<f4, 'fortran_order': False, 'shape': (4,)}"), "not a valid dict literal"));
        CHECK(contains(dict_err("{'descr': '<f\\x34', 'fortran_order': False, 'shape': (4,)}"), "escape sequences"));
        CHECK(
            contains(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), 'extra': 1}"), "unexpected key 'extra'"));
        CHECK(contains(dict_err("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (4,)}"),
                       "duplicate key 'descr'"));
        CHECK(contains(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (4,)} x"), "unexpected text after"));
        CHECK(contains(dict_err("{descr: '<f4', 'fortran_order': False, 'shape': (4,)}"), "expected a quoted string"));
        CHECK(contains(dict_err(""), "expected '{'"));
        CHECK(contains(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (-4,)}"), "negative extent"));
        CHECK(
            contains(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}"), "overflows int64"));
    }
    SUBCASE("missing keys") {
        CHECK(contains(dict_err("{'fortran_order': False, 'shape': (4,), }"), "missing key 'descr'"));
        CHECK(contains(dict_err("{'descr': '<f4', 'shape': (4,), }"), "missing key 'fortran_order'"));
        CHECK(contains(dict_err("{'descr': '<f4', 'fortran_order': False, }"), "missing key 'shape'"));
        CHECK(contains(dict_err("{}"), "missing key 'descr'"));
    }
    SUBCASE("fortran order") {
        CHECK(dict_err("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }") ==
              "[rpe.npy] bad.npy: fortran_order True is not supported (C order only)");
    }
    SUBCASE("big-endian or unsupported dtype") {
        CHECK(dict_err("{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }") ==
              "[rpe.npy] bad.npy: big-endian dtype '>f4' is not supported");
        CHECK(contains(dict_err("{'descr': '>i8', 'fortran_order': False, 'shape': (2,), }"), "big-endian"));
        CHECK(dict_err("{'descr': '<f2', 'fortran_order': False, 'shape': (8,), }") ==
              "[rpe.npy] bad.npy: unsupported dtype '<f2'");
        CHECK(contains(dict_err("{'descr': '<c8', 'fortran_order': False, 'shape': (2,), }"), "unsupported dtype '<c8'"));
        CHECK(contains(dict_err("{'descr': '|f4', 'fortran_order': False, 'shape': (4,), }"), "unsupported dtype"));
        CHECK(contains(dict_err("{'descr': '', 'fortran_order': False, 'shape': (4,), }"), "unsupported dtype ''"));
        CHECK(contains(dict_err("{'descr': '<U3', 'fortran_order': False, 'shape': (4,), }"), "unsupported dtype"));
    }
    SUBCASE("data truncated or trailing bytes") {
        CHECK(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }") ==
              "[rpe.npy] bad.npy: data truncated: shape needs 20 bytes, file holds 16");
        CHECK(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }") ==
              "[rpe.npy] bad.npy: trailing bytes: shape needs 12 bytes, file holds 16");
        CHECK(contains(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (0,), }"), "trailing bytes"));
        CHECK(contains(dict_err("{'descr': '<f8', 'fortran_order': False, 'shape': (), }"), "trailing bytes"));
        CHECK(contains(dict_err("{'descr': '<f8', 'fortran_order': False, 'shape': (1000000000000,), }"), "data truncated"));
    }
    SUBCASE("shape product overflow") {
        CHECK(contains(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }"),
                       "bad.npy: shape product overflows"));
        CHECK(contains(dict_err("{'descr': '|u1', 'fortran_order': False, 'shape': (9223372036854775807, 2), }"),
                       "shape product overflows"));
        CHECK(contains(dict_err("{'descr': '<f8', 'fortran_order': False, 'shape': (2305843009213693952,), }"),
                       "shape product overflows"));
        // a zero extent makes the element count 0, but the non-zero extents must still fit
        // (numpy's rule; issue 16: sizes computed from such a shape overflowed)
        CHECK(contains(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 9223372036854775807), }"),
                       "shape product overflows: 1 * 9223372036854775807"));
        // a 0-element array whose non-zero extents fit: here with trailing data
        CHECK(contains(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 2147483648), }"), "trailing bytes"));
    }
}

TEST_CASE("npy: float64 to float32 narrows as IEEE does, also beyond float32's max") {
    constexpr float max = std::numeric_limits<float>::max();
    const double m = max;
    const double half_ulp = std::ldexp(1.0, 103);  // ulp(max) = 2^104
    using rpe::io::detail::npy_float_to_float;
    CHECK(npy_float_to_float<float>(m * (1 + std::ldexp(1.0, -30))) == max);  // numpy: float32(max) too
    CHECK(npy_float_to_float<float>(-m * (1 + std::ldexp(1.0, -30))) == -max);
    CHECK(npy_float_to_float<float>(m + half_ulp) == std::numeric_limits<float>::infinity());  // the tie: to even
    CHECK(npy_float_to_float<float>(std::nextafter(m + half_ulp, 0.0)) == max);
    CHECK(npy_float_to_float<float>(1e300) == std::numeric_limits<float>::infinity());
    CHECK(npy_float_to_float<float>(-1e300) == -std::numeric_limits<float>::infinity());
    CHECK(npy_float_to_float<float>(1.5) == 1.5f);
}

TEST_CASE("npy: encode_npy argument errors") {
    const float x = 0;
    const std::int64_t neg[] = {2, -1};
    CHECK_THROWS_AS((void)rpe::io::encode_npy(&x, neg), rpe::invalid_argument);
    const std::int64_t huge[] = {std::numeric_limits<std::int64_t>::max(), 2};
    CHECK_THROWS_AS((void)rpe::io::encode_npy(&x, huge), rpe::invalid_argument);
    const std::int64_t s[] = {1};
    const std::string e = npy_error_of<rpe::runtime_error>([&] { rpe::io::save_npy("/nonexistent/dir/out.npy", &x, s); });
    CHECK(e ==
          "[rpe.npy] /nonexistent/dir/out.npy: cannot create a temporary file in its folder (No such file or "
          "directory); /nonexistent/dir/out.npy is unchanged");
}

TEST_CASE("npy: hand-built npy_array inconsistencies are reported, not read out of bounds") {
    rpe::io::npy_array a;
    a.dtype = "<f4";
    a.shape = {3};
    a.bytes.resize(8);
    a.source = "hand";
    CHECK_THROWS_AS((void)a.to<float>(), rpe::runtime_error);
    CHECK_THROWS_AS((void)a.as<float>(), rpe::runtime_error);
    a.dtype = "<f2";
    CHECK_THROWS_AS((void)a.to<float>(), rpe::runtime_error);
    CHECK(a.itemsize() == 0);
    CHECK_FALSE(a.is_float());
}

TEST_CASE("npy: malformed variants of a valid file never crash") {
    const std::vector<std::int32_t> v = {1, 2, 3, 4, 5, 6};
    const std::int64_t s[] = {2, 3};
    const auto good = rpe::io::encode_npy(v.data(), s);
    int parsed = 0, rejected = 0;
    // every truncation
    for (std::size_t n = 0; n < good.size(); ++n) {
        const std::vector<std::byte> cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
        try {
            (void)rpe::io::parse_npy(cut, "cut.npy");
            ++parsed;
        } catch (const rpe::runtime_error&) {
            ++rejected;
        }
    }
    CHECK(parsed == 0);
    CHECK(rejected == static_cast<int>(good.size()));
    // every header byte replaced by a few interesting values
    parsed = rejected = 0;
    REQUIRE(good.size() == 128 + 24);
    for (std::size_t i = 0; i < 128; ++i) {
        for (int c : {0x00, 0x20, 0x27, 0x28, 0x29, 0x2c, 0x30, 0x39, 0x7b, 0x7d, 0x80, 0xff}) {
            auto f = good;
            f[i] = static_cast<std::byte>(c);
            try {
                const auto a = rpe::io::parse_npy(f, "flip.npy");
                REQUIRE(a.bytes.size() == a.size() * a.itemsize());
                ++parsed;
            } catch (const rpe::runtime_error&) {
                ++rejected;
            }
        }
    }
    CHECK(parsed > 0);  // e.g. padding spaces replaced by other whitespace-free-but-harmless bytes
    CHECK(rejected > 0);
}

TEST_CASE("npy: save_npy refuses more extents than load_npy reads back (64), before touching the file") {
    const std::vector<std::int64_t> ok(64, 1), too_many(65, 1);
    const float one = 1.0f;
    CHECK_NOTHROW((void)rpe::io::encode_npy(&one, std::span<const std::int64_t>(ok)));
    CHECK_THROWS_WITH_AS((void)rpe::io::encode_npy(&one, std::span<const std::int64_t>(too_many)),
                         doctest::Contains("[rpe.npy] shape has 65 extents; expected at most 64"), rpe::invalid_argument);
    const auto path = std::filesystem::temp_directory_path() / ("rpe_npy_rank65_" + std::to_string(::getpid()) + ".npy");
    std::filesystem::remove(path);
    CHECK_THROWS_AS(rpe::io::save_npy(path.string(), &one, std::span<const std::int64_t>(too_many)), rpe::invalid_argument);
    CHECK_FALSE(std::filesystem::exists(path));
}

}  // namespace rpe_unit_io_npy
