// vit_digits: end-to-end check of rpe on two small DeiT + iRPE models really trained on the UCI
// handwritten digits (examples/data/digits, see its README.md).
//
//   vit_digits [--stages] [DATA_DIR]   (default: the folder baked in at build time, RPE_DIGITS_DATA_DIR)
//
// --stages adds one line per model with the float forward's time per stage (patch embedding,
// LayerNorm, qkv GEMM, repacking, attention, projection, MLP GEMMs, GELU, head).
//
// For each model (a: product / contextual / qkv, b: euc / bias / k) it loads the weights and the
// configuration from the .safetensors file, runs the 450 test images in float, and compares with
// the PyTorch float32 logits: accuracy, argmax agreement, max |ours - reference|, images/s; then
// the same in double against the float64 logits. Model a's debug tensors (tokens, block 0 output,
// block 0 attention for the first 4 images) are checked too. The last line per model is
//   model a: accuracy 0.9889 reference 0.9889 argmax_agree 450/450 max_abs_diff 3.1e-06
// Exit status 1 when a check fails (argmax differs, |diff| > 1e-4, accuracy != reference's,
// debug tensors > 1e-5, float64 > 1e-9), 2 on an error (missing file, bad model).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <rpe/io/npy.hpp>

#include "vit_digits.hpp"

#ifndef RPE_DIGITS_DATA_DIR
#define RPE_DIGITS_DATA_DIR "examples/data/digits"
#endif

namespace {

constexpr double logits_tolerance = 1e-4;  // README: about 20x the float32-vs-float64 gap
constexpr double debug_tolerance = 1e-5;
constexpr double f64_tolerance = 1e-9;  // README: a float64 implementation meets ~1e-10

/// The instruction sets the compiler was allowed to use for this build, from its predefined
/// macros, the vector paths of rpe's CPU kernels, and how they were chosen: e.g. "AVX-512F AVX2
/// FMA, rpe kernels AVX-512F (-march=native, CMake option RPE_NATIVE)", "x86-64 baseline (SSE2),
/// rpe kernels SSE2".
std::string build_isa() {
    std::string isa;
    auto add = [&isa](const char* name) {
        if (!isa.empty()) isa += ' ';
        isa.append(name);
    };
#if defined(__AVX512F__)
    add("AVX-512F");
#endif
#if defined(__AVX2__)
    add("AVX2");
#elif defined(__AVX__)
    add("AVX");
#endif
#if defined(__FMA__)
    add("FMA");
#endif
    if (isa.empty()) {
#if defined(__x86_64__) || defined(_M_X64)
        isa = "x86-64 baseline (SSE2)";
#elif defined(__ARM_NEON)
        isa = "AArch64 NEON";
#else
        isa = "the compiler's default ISA";
#endif
    }
    isa += std::string(", rpe kernels ") + rpe::detail::cpu::simd_isa();
#if defined(RPE_BUILD_MARCH)
    if (std::string(RPE_BUILD_MARCH) == "native") isa += " (-march=native, CMake option RPE_NATIVE)";
#endif
    return isa;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
    double m = 0;
    for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
    return m;
}

template <class S>
std::vector<int> argmaxes(const std::vector<S>& logits, int classes) {
    std::vector<int> out(logits.size() / static_cast<std::size_t>(classes));
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = rpe::examples::argmax(logits.data() + i * classes, classes);
    return out;
}

int count_equal(const std::vector<int>& a, const std::vector<std::int64_t>& b) {
    int n = 0;
    for (std::size_t i = 0; i < a.size(); ++i) n += a[i] == b[i];
    return n;
}
int count_equal(const std::vector<int>& a, const std::vector<int>& b) {
    int n = 0;
    for (std::size_t i = 0; i < a.size(); ++i) n += a[i] == b[i];
    return n;
}

/// Runs one model; returns true when every check passes.
bool run_model(const std::string& dir, char name, const std::vector<float>& images, const std::vector<std::int64_t>& labels,
               bool stages) {
    using rpe::examples::vit_digits;
    const std::string tag(1, name);
    const auto model = vit_digits<float>::load(dir + "/deit_irpe_digits_" + tag + ".safetensors");
    const auto& c = model.config();
    const auto n = static_cast<std::int64_t>(labels.size());
    std::printf("model %c: depth %d, C %d, H %d, D %d, L %d, rpe_method %s, rpe_mode %s, rpe_on %s, K %d, shared_head %s\n", name,
                c.depth, c.embed_dim, c.num_heads, c.head_dim, c.tokens,
                model.config().rpe.method == rpe::method::product ? "product" : "euc", c.rpe.contextual ? "contextual" : "bias",
                c.rpe_on.c_str(), c.rpe_num_buckets, c.rpe.shared_head ? "true" : "false");

    const rpe::tensor_ref<const float> in(images.data(), {n, c.in_chans, c.img_size, c.img_size});
    std::vector<float> logits(static_cast<std::size_t>(n * c.num_classes));
    double best = 1e300;
    for (int run = 0; run < 3; ++run) {
        const auto t0 = std::chrono::steady_clock::now();
        model.forward(in, rpe::tensor_ref<float>(logits.data(), {n, c.num_classes}));
        const auto t1 = std::chrono::steady_clock::now();
        best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
    }

    const auto ref = rpe::io::load_npy(dir + "/logits_" + tag + ".npy").as<float>();
    if (ref.size() != logits.size()) {
        std::printf("model %c: logits_%c.npy holds %zu values; expected %zu\n", name, name, ref.size(), logits.size());
        return false;
    }
    const auto ours = argmaxes(logits, c.num_classes), theirs = argmaxes(ref, c.num_classes);
    const int correct = count_equal(ours, labels), ref_correct = count_equal(theirs, labels);
    const int agree = count_equal(ours, theirs);
    const double diff = max_abs_diff(logits, ref);
    const double acc = static_cast<double>(correct) / static_cast<double>(n);
    const double ref_acc = static_cast<double>(ref_correct) / static_cast<double>(n);
    std::printf("model %c: accuracy %.4f (%d/%lld), reference %.4f (%d/%lld)\n", name, acc, correct, static_cast<long long>(n),
                ref_acc, ref_correct, static_cast<long long>(n));
    std::printf("model %c: argmax agreement %d/%lld, max |logits - logits_%c.npy| = %.3g (tolerance %.0e)\n", name, agree,
                static_cast<long long>(n), name, diff, logits_tolerance);
    std::printf("model %c: %.0f images/s (float, %lld images in %.2f ms, best of 3, chunks of %d)\n", name,
                static_cast<double>(n) / best, static_cast<long long>(n), best * 1e3, model.chunk_size());
    bool ok = agree == n && diff <= logits_tolerance && correct == ref_correct;
    if (stages) {  // 5 more runs timed stage by stage (CPU ms, summed over threads); each stage's best
        rpe::examples::vit_digits_stage_times t;
        for (int run = 0; run < 5; ++run) {
            rpe::examples::vit_digits_stage_times r;
            model.forward(in, rpe::tensor_ref<float>(logits.data(), {n, c.num_classes}), nullptr, &r);
            t = run == 0 ? r : t.min(r);
        }
        std::printf(
            "model %c: stages (ms per %lld images, each stage's best of 5): patch_embed %.2f, layer_norm %.2f, qkv %.2f, repack "
            "%.2f, "
            "attention %.2f, proj %.2f, mlp %.2f, gelu %.2f, head %.2f, total %.2f\n",
            name, static_cast<long long>(n), t.patch_embed * 1e3, t.layer_norm * 1e3, t.qkv * 1e3, t.repack * 1e3,
            t.attention * 1e3, t.proj * 1e3, t.mlp * 1e3, t.gelu * 1e3, t.head * 1e3, t.total() * 1e3);
    }

    if (name == 'a') {  // debug tensors: first 4 images
        const std::string tokens_path = dir + "/debug_a_tokens.npy";
        if (std::FILE* f = std::fopen(tokens_path.c_str(), "rb")) {
            std::fclose(f);
            const auto tokens = rpe::io::load_npy(tokens_path);
            const auto block0 = rpe::io::load_npy(dir + "/debug_a_block0.npy").as<float>();
            const auto attn0 = rpe::io::load_npy(dir + "/debug_a_block0_attn.npy").as<float>();
            const std::int64_t m = tokens.shape.at(0);
            rpe::examples::vit_digits_trace<float> trace;
            std::vector<float> small(static_cast<std::size_t>(m * c.num_classes));
            model.forward(rpe::tensor_ref<const float>(images.data(), {m, c.in_chans, c.img_size, c.img_size}),
                          rpe::tensor_ref<float>(small.data(), {m, c.num_classes}), &trace);
            const double d_tok = max_abs_diff(trace.tokens, tokens.as<float>());
            const double d_blk = max_abs_diff(trace.blocks.at(0), block0);
            const double d_att = max_abs_diff(trace.attn.at(0), attn0);
            std::printf(
                "model a: debug (first %lld images) max diff: tokens %.3g, block0 %.3g, block0_attn %.3g (tolerance %.0e)\n",
                static_cast<long long>(m), d_tok, d_blk, d_att, debug_tolerance);
            const bool sizes = trace.tokens.size() == tokens.size() && trace.blocks.at(0).size() == block0.size() &&
                               trace.attn.at(0).size() == attn0.size();
            ok = ok && sizes && d_tok <= debug_tolerance && d_blk <= debug_tolerance && d_att <= debug_tolerance;
        }
    }

    // float64: same model with weights and inputs cast up, against the PyTorch float64 logits.
    const std::string f64_path = dir + "/logits_" + tag + "_f64.npy";
    if (std::FILE* f = std::fopen(f64_path.c_str(), "rb")) {
        std::fclose(f);
        const auto model64 = vit_digits<double>::load(dir + "/deit_irpe_digits_" + tag + ".safetensors");
        const std::vector<double> images64(images.begin(), images.end());
        std::vector<double> logits64(logits.size());
        const auto t0 = std::chrono::steady_clock::now();
        model64.forward(rpe::tensor_ref<const double>(images64.data(), {n, c.in_chans, c.img_size, c.img_size}),
                        rpe::tensor_ref<double>(logits64.data(), {n, c.num_classes}));
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const auto ref64 = rpe::io::load_npy(f64_path).as<double>();
        double d64 = 0;
        for (std::size_t i = 0; i < ref64.size() && i < logits64.size(); ++i)
            d64 = std::max(d64, std::fabs(logits64[i] - ref64[i]));
        const int agree64 = count_equal(argmaxes(logits64, c.num_classes), argmaxes(ref64, c.num_classes));
        std::printf(
            "model %c: float64 max |logits - logits_%c_f64.npy| = %.3g (tolerance %.0e), argmax agreement %d/%lld, "
            "%.0f images/s\n",
            name, name, d64, f64_tolerance, agree64, static_cast<long long>(n), static_cast<double>(n) / secs);
        ok = ok && ref64.size() == logits64.size() && d64 <= f64_tolerance && agree64 == n;
    }

    std::printf("model %c: accuracy %.4f reference %.4f argmax_agree %d/%lld max_abs_diff %.1e\n", name, acc, ref_acc, agree,
                static_cast<long long>(n), diff);
    if (!ok) std::printf("model %c: FAILED\n", name);
    return ok;
}

}  // namespace

int main(int argc, char** argv) {
    std::string dir = RPE_DIGITS_DATA_DIR;
    bool stages = false;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--stages")
            stages = true;
        else if (arg.rfind("--", 0) == 0) {
            std::fprintf(stderr, "vit_digits: error: unknown option %s; usage: vit_digits [--stages] [DATA_DIR]\n", arg.c_str());
            return 2;
        } else
            dir = arg;
    }
    try {
        std::printf("vit_digits: built for %s\n", build_isa().c_str());
        std::printf("vit_digits: data %s\n", dir.c_str());
        const auto images_npy = rpe::io::load_npy(dir + "/test_images.npy");
        const auto images = images_npy.as<float>();
        const auto labels = rpe::io::load_npy(dir + "/test_labels.npy").to<std::int64_t>();
        if (images_npy.rank() != 4 || images_npy.shape[0] != static_cast<std::int64_t>(labels.size())) {
            std::printf("vit_digits: test_images.npy has %zu dims / %zu labels; expected (N, 1, 16, 16) and N labels\n",
                        images_npy.rank(), labels.size());
            return 2;
        }
        std::printf("vit_digits: %zu test images (%lld x %lld x %lld)\n", labels.size(),
                    static_cast<long long>(images_npy.shape[1]), static_cast<long long>(images_npy.shape[2]),
                    static_cast<long long>(images_npy.shape[3]));
        // The stored inputs are the raw 8x8 digits upsampled and normalised; redo that here.
        const std::string raw_path = dir + "/test_images_raw.npy";
        if (std::FILE* f = std::fopen(raw_path.c_str(), "rb")) {
            std::fclose(f);
            const auto raw = rpe::io::load_npy(raw_path);
            const auto redone = rpe::examples::preprocess_digits<float>(raw.as<std::uint8_t>(), static_cast<int>(raw.shape.at(1)),
                                                                        static_cast<int>(images_npy.shape[2]));
            std::printf("vit_digits: preprocessing test_images_raw.npy reproduces test_images.npy: %s\n",
                        redone == images ? "bit-identical" : "DIFFERENT");
        }
        bool ok = true;
        for (const char name : {'a', 'b'}) ok = run_model(dir, name, images, labels, stages) && ok;
        return ok ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "vit_digits: error: %s\n", e.what());
        return 2;
    }
}
