// End-to-end test: the two DeiT + iRPE digits models of examples/data/digits, run with the
// library's attention (examples/vit_digits/vit_digits.hpp) on the 450 test images and compared
// with the PyTorch reference (README.md in that folder: tolerance 1e-4 on the float32 logits,
// 1e-5 on model A's debug tensors).
//
// Optimised builds run the whole test set (about a second). Unoptimised builds (Debug, the
// sanitizer presets) run Eigen tens of times slower, so there the logits are checked on the
// first 16 images only, and the accuracy counts of the whole set are not asserted.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <rpe/io/npy.hpp>
#include <rpe/io/safetensors.hpp>

#include "../../examples/vit_digits/vit_digits.hpp"

#if defined(_OPENMP)
#include <omp.h>

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_vit_digits {
#endif

#ifndef RPE_TEST_DATA_DIR
#error "RPE_TEST_DATA_DIR must be defined (path of tests/data)"
#endif

namespace {

const std::string digits_dir = RPE_TEST_DATA_DIR "/../../examples/data/digits";

#if defined(__OPTIMIZE__) || (!defined(__GNUC__) && defined(NDEBUG))
constexpr bool digits_full_set = true;
#else
constexpr bool digits_full_set = false;
#endif
constexpr std::int64_t digits_subset = 16;  // images checked in unoptimised builds

template <class T>
double digits_max_abs_diff(const std::vector<T>& a, const std::vector<T>& b) {
    REQUIRE(a.size() == b.size());
    double m = 0;
    for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    return m;
}

struct digits_result {
    int agree = 0, correct = 0, ref_correct = 0, n = 0;
    double max_diff = 0;
};

/// Runs model `tag` in scalar S on the whole test set against `logits_<tag><suffix>.npy`.
template <class S>
digits_result run_digits_model(const std::string& tag, const std::string& suffix) {
    const auto model = rpe::examples::vit_digits<S>::load(digits_dir + "/deit_irpe_digits_" + tag + ".safetensors");
    const auto& c = model.config();
    const auto images = rpe::io::load_npy(digits_dir + "/test_images.npy").to<S>();
    const auto labels = rpe::io::load_npy(digits_dir + "/test_labels.npy").to<std::int64_t>();
    const auto ref = rpe::io::load_npy(digits_dir + "/logits_" + tag + suffix + ".npy").to<S>();
    REQUIRE(labels.size() == 450);
    REQUIRE(images.size() == labels.size() * static_cast<std::size_t>(c.in_chans * c.img_size * c.img_size));
    REQUIRE(ref.size() == labels.size() * static_cast<std::size_t>(c.num_classes));
    const std::int64_t n = digits_full_set ? static_cast<std::int64_t>(labels.size()) : digits_subset;
    if (!digits_full_set) MESSAGE("unoptimised build: checking the first " << n << " of " << labels.size() << " images only");
    std::vector<S> logits(static_cast<std::size_t>(n * c.num_classes));
    model.forward(rpe::tensor_ref<const S>(images.data(), {n, c.in_chans, c.img_size, c.img_size}),
                  rpe::tensor_ref<S>(logits.data(), {n, c.num_classes}));
    digits_result r;
    r.n = static_cast<int>(n);
    r.max_diff = digits_max_abs_diff(logits, std::vector<S>(ref.begin(), ref.begin() + n * c.num_classes));
    for (std::int64_t i = 0; i < n; ++i) {
        const int ours = rpe::examples::argmax(logits.data() + i * c.num_classes, c.num_classes);
        const int theirs = rpe::examples::argmax(ref.data() + i * c.num_classes, c.num_classes);
        r.agree += ours == theirs;
        r.correct += ours == labels[static_cast<std::size_t>(i)];
        r.ref_correct += theirs == labels[static_cast<std::size_t>(i)];
    }
    return r;
}

}  // namespace

TEST_CASE("vit_digits: model a (product, contextual, qkv) matches the PyTorch logits on the test set") {
    const auto r = run_digits_model<float>("a", "");
    CHECK(r.agree == r.n);
    CHECK(r.max_diff <= 1e-4);
    CHECK(r.correct == r.ref_correct);
    if (digits_full_set) {
        CHECK(r.n == 450);
        CHECK(r.ref_correct == 445);
    }
}

TEST_CASE("vit_digits: model b (euc, bias, k, per-head tables) matches the PyTorch logits on the test set") {
    const auto r = run_digits_model<float>("b", "");
    CHECK(r.agree == r.n);
    CHECK(r.max_diff <= 1e-4);
    CHECK(r.correct == r.ref_correct);
    if (digits_full_set) {
        CHECK(r.n == 450);
        CHECK(r.ref_correct == 428);
    }
}

TEST_CASE("vit_digits: float64 models match the PyTorch float64 logits to 1e-9") {
    for (const std::string tag : {"a", "b"}) {
        CAPTURE(tag);
        const auto r = run_digits_model<double>(tag, "_f64");
        CHECK(r.agree == r.n);
        CHECK(r.max_diff <= 1e-9);
    }
}

TEST_CASE("vit_digits: model a debug tensors (tokens, block 0 output and attention) within 1e-5") {
    const auto model = rpe::examples::vit_digits<float>::load(digits_dir + "/deit_irpe_digits_a.safetensors");
    const auto& c = model.config();
    const auto tokens = rpe::io::load_npy(digits_dir + "/debug_a_tokens.npy");
    const auto block0 = rpe::io::load_npy(digits_dir + "/debug_a_block0.npy").as<float>();
    const auto attn0 = rpe::io::load_npy(digits_dir + "/debug_a_block0_attn.npy").as<float>();
    const std::int64_t m = tokens.shape.at(0);
    REQUIRE(m == 4);
    const auto images = rpe::io::load_npy(digits_dir + "/test_images.npy").as<float>();
    std::vector<float> logits(static_cast<std::size_t>(m * c.num_classes));
    rpe::examples::vit_digits_trace<float> trace;
    model.forward(rpe::tensor_ref<const float>(images.data(), {m, c.in_chans, c.img_size, c.img_size}),
                  rpe::tensor_ref<float>(logits.data(), {m, c.num_classes}), &trace);
    CHECK(digits_max_abs_diff(trace.tokens, tokens.as<float>()) <= 1e-5);
    REQUIRE(trace.blocks.size() == 4);
    CHECK(digits_max_abs_diff(trace.blocks[0], block0) <= 1e-5);
    CHECK(digits_max_abs_diff(trace.attn[0], attn0) <= 1e-5);
}

TEST_CASE("vit_digits: logits do not depend on the chunk size, the thread count or tracing") {
    // The untraced forward runs the last block's MLP on the class tokens only and the chunks in
    // parallel; the traced one runs every row, serially. All must agree to float rounding (a
    // chunk size changes which Eigen kernel a row gets: 5e-7 seen; the reference tolerance is 1e-4).
    for (const std::string tag : {"a", "b"}) {
        CAPTURE(tag);
        auto model = rpe::examples::vit_digits<float>::load(digits_dir + "/deit_irpe_digits_" + tag + ".safetensors");
        const auto& c = model.config();
        const auto images = rpe::io::load_npy(digits_dir + "/test_images.npy").as<float>();
        const std::int64_t n = 37;  // not a multiple of any chunk size below
        const rpe::tensor_ref<const float> in(images.data(), {n, c.in_chans, c.img_size, c.img_size});
        auto run = [&](int chunk, rpe::examples::vit_digits_trace<float>* trace) {
            model.set_chunk_size(chunk);
            std::vector<float> logits(static_cast<std::size_t>(n * c.num_classes));
            model.forward(in, rpe::tensor_ref<float>(logits.data(), {n, c.num_classes}), trace);
            return logits;
        };
        const auto base = run(16, nullptr);
        CHECK(digits_max_abs_diff(run(5, nullptr), base) <= 1e-5);
        CHECK(digits_max_abs_diff(run(64, nullptr), base) <= 1e-5);
        rpe::examples::vit_digits_trace<float> trace;
        CHECK(digits_max_abs_diff(run(16, &trace), base) <= 1e-5);
        CHECK(trace.blocks.at(static_cast<std::size_t>(c.depth - 1)).size() ==
              static_cast<std::size_t>(n * c.tokens * c.embed_dim));
#if defined(_OPENMP)
        const int threads = omp_get_max_threads();
        omp_set_num_threads(1);
        const auto serial = run(16, nullptr);
        omp_set_num_threads(threads);
        CHECK(serial == base);  // the same chunks computed the same way: bit for bit
#endif
    }
}

TEST_CASE("vit_digits: the models' bucket ids equal bucket_ids_{a,b}.npy") {
    for (const std::string tag : {"a", "b"}) {
        CAPTURE(tag);
        const auto model = rpe::examples::vit_digits<float>::load(digits_dir + "/deit_irpe_digits_" + tag + ".safetensors");
        const auto& c = model.config();
        const auto expected = rpe::io::load_npy(digits_dir + "/bucket_ids_" + tag + ".npy").to<std::int64_t>();
        REQUIRE(expected.size() == static_cast<std::size_t>(c.tokens) * c.tokens);
        for (const auto t : {rpe::target::query, rpe::target::key, rpe::target::value}) {
            const auto* term = model.rpe_term(t);
            if (!term) continue;
            const auto ids = term->bucket_ids(c.grid, c.grid);
            int mismatches = 0;
            for (int i = 0; i < c.tokens; ++i)
                for (int j = 0; j < c.tokens; ++j)
                    mismatches += ids->at(0, i, j) != expected[static_cast<std::size_t>(i * c.tokens + j)];
            CHECK(mismatches == 0);
        }
    }
}

TEST_CASE("vit_digits: preprocessing the raw digits reproduces test_images.npy bit for bit") {
    const auto raw = rpe::io::load_npy(digits_dir + "/test_images_raw.npy");
    const auto images = rpe::io::load_npy(digits_dir + "/test_images.npy").as<float>();
    CHECK(rpe::examples::preprocess_digits<float>(raw.as<std::uint8_t>(), 8, 16) == images);
}

TEST_CASE("vit_digits: shapes and metadata are checked") {
    const auto model = rpe::examples::vit_digits<float>::load(digits_dir + "/deit_irpe_digits_b.safetensors");
    const auto& c = model.config();
    CHECK(c.depth == 2);
    CHECK(c.rpe_num_buckets == 8);
    CHECK(c.rpe_on == "k");
    CHECK(model.rpe_term(rpe::target::key) != nullptr);
    CHECK(model.rpe_term(rpe::target::query) == nullptr);
    std::vector<float> images(2 * 16 * 16), logits(2 * 10);
    CHECK_THROWS_AS(
        model.forward(rpe::tensor_ref<const float>(images.data(), {2, 1, 8, 32}), rpe::tensor_ref<float>(logits.data(), {2, 10})),
        rpe::invalid_argument);
    CHECK_THROWS_AS(
        model.forward(rpe::tensor_ref<const float>(images.data(), {2, 1, 16, 16}), rpe::tensor_ref<float>(logits.data(), {2, 5})),
        rpe::invalid_argument);
    CHECK_THROWS_AS(rpe::examples::vit_digits<float>::load(digits_dir + "/no_such_model.safetensors"), rpe::runtime_error);
}

namespace {

/// Model A's file with `from` replaced by `to` (same length) in the header, parsed in memory.
rpe::io::safetensors_file digits_patched_model(const std::string& from, const std::string& to) {
    REQUIRE(from.size() == to.size());
    std::ifstream in(digits_dir + "/deit_irpe_digits_a.safetensors", std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto pos = text.find(from);
    REQUIRE(pos != std::string::npos);
    text.replace(pos, from.size(), to);
    std::vector<std::byte> bytes(text.size());
    std::memcpy(bytes.data(), text.data(), text.size());
    return rpe::io::safetensors_file::parse(std::move(bytes), "patched_a.safetensors");
}

std::string digits_error_of(const std::string& from, const std::string& to) {
    try {
        rpe::examples::vit_digits<float> model(digits_patched_model(from, to));
    } catch (const rpe::invalid_argument& e) {
        return e.what();
    }
    return "did not throw";
}

/// Model A's file with metadata `key` set to `value` (the header re-encoded), parsed in memory.
std::string digits_error_with_metadata(const std::string& key, const std::string& value) {
    std::ifstream in(digits_dir + "/deit_irpe_digits_a.safetensors", std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    REQUIRE(text.size() >= 8);
    std::uint64_t n = 0;
    for (int i = 0; i < 8; ++i)
        n |= static_cast<std::uint64_t>(static_cast<unsigned char>(text[static_cast<std::size_t>(i)])) << (8 * i);
    auto header = nlohmann::json::parse(text.substr(8, static_cast<std::size_t>(n)));
    header["__metadata__"][key] = value;
    std::string h = header.dump();
    h.append((8 - h.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((h.size() >> (8 * i)) & 0xff);
    out += h;
    out += text.substr(8 + static_cast<std::size_t>(n));
    std::vector<std::byte> bytes(out.size());
    std::memcpy(bytes.data(), out.data(), out.size());
    try {
        rpe::examples::vit_digits<float> model(rpe::io::safetensors_file::parse(std::move(bytes), "edited_a.safetensors"));
    } catch (const rpe::invalid_argument& e) {
        return e.what();
    }
    return "did not throw";
}

}  // namespace

TEST_CASE("vit_digits: metadata sizes are checked before they size anything") {
    // grid = 2000000000 / 2: 1 + grid^2 tokens would overflow int
    CHECK(digits_error_with_metadata("img_size", "2000000000") ==
          "[rpe.vit_digits] edited_a.safetensors: img_size / patch_size = 1000000000; expected at most 46340 (the 1 + "
          "grid^2 tokens must fit int)");
    // 2^31 does not fit the int it is read into
    CHECK(digits_error_with_metadata("depth", "2147483648") ==
          "[rpe.vit_digits] edited_a.safetensors: metadata depth = '2147483648' is not a valid integer");
}

TEST_CASE("vit_digits: a file whose metadata disagrees with the library is rejected with a clear message") {
    // K = 50 for product with beta 3.8 and skip 1; a file claiming 51 must not load.
    const auto k = digits_error_of(R"("rpe_num_buckets":"50")", R"("rpe_num_buckets":"51")");
    CHECK(k.find("rpe_num_buckets = 51") != std::string::npos);
    CHECK(k.find("K = 50") != std::string::npos);
    // a tensor whose shape does not match the metadata (num_heads 4 -> 2 gives head_dim 32)
    const auto h = digits_error_of(R"("num_heads":"4")", R"("num_heads":"2")");
    CHECK(h.find("lookup_table_weight") != std::string::npos);
    CHECK(h.find("(1, 32, 50)") != std::string::npos);
    // an unparsable number names the key
    const auto d = digits_error_of(R"("depth":"4")", R"("depth":"x")");
    CHECK(d.find("depth = 'x'") != std::string::npos);
}

}  // namespace rpe_unit_vit_digits
