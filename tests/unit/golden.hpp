// Shared helpers of the core unit tests (tests/unit/test_core_*.cpp): loading golden .npy files
// into vectors, building tensor_refs, the golden README's tolerance rule, exact integer
// comparison, catching an expected exception to inspect its message (throws_with), seeded random
// data, and term_problem (a random problem in the reference's shapes for one rpe::term type).
//
// Kept free of nlohmann/json on purpose (it costs seconds per translation unit): the helpers that
// read meta.json are templates on the json type, so only the files that use them include it.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <rpe/bucket_cache.hpp>
#include <rpe/io/npy.hpp>
#include <rpe/mode.hpp>
#include <rpe/tensor.hpp>

#ifndef RPE_TEST_DATA_DIR
#error "RPE_TEST_DATA_DIR must be defined (path of tests/data)"
#endif

namespace rpe_test {

/// tests/data/golden/<rel>.
inline std::string golden(const std::string& rel) { return std::string(RPE_TEST_DATA_DIR) + "/golden/" + rel; }

/// Loads `dir/file` as T; when `shape` is given, checks the file's shape first (REQUIRE: the
/// rest of a test is meaningless with a wrong-sized buffer).
template <class T>
std::vector<T> load(const std::string& dir, const std::string& file, const std::vector<std::int64_t>& shape = {}) {
    const auto a = rpe::io::load_npy(dir + "/" + file);
    if (!shape.empty()) {
        INFO("file: " << dir << "/" << file);
        REQUIRE(a.shape == shape);
    }
    return a.to<T>();
}

/// A tensor_ref over `v` with a run-time shape (the tensor_ref constructor takes an
/// initializer_list; meta.json gives vectors).
template <class T>
rpe::tensor_ref<T> view(T* data, const std::vector<std::int64_t>& shape) {
    return rpe::tensor_ref<T>(data, std::span<const std::int64_t>(shape));  // checks rank <= 4
}
template <class T>
rpe::tensor_ref<const T> cview(const std::vector<T>& v, const std::vector<std::int64_t>& shape) {
    return view<const T>(v.data(), shape);
}
template <class T>
rpe::tensor_ref<T> mview(std::vector<T>& v, const std::vector<std::int64_t>& shape) {
    return view<T>(v.data(), shape);
}

/// The (L, L) ids of table `t` as ints, row-major.
inline std::vector<int> ids_matrix(const rpe::bucket_ids& ids, int t = 0) {
    const int n = ids.length();
    std::vector<int> v(static_cast<std::size_t>(n) * static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j)
            v[static_cast<std::size_t>(i) * static_cast<std::size_t>(n) + static_cast<std::size_t>(j)] = ids.at(t, i, j);
    return v;
}

/// Exact comparison of integer arrays: one CHECK, naming the first differing element.
template <class A, class E>
void check_exact(const std::vector<A>& actual, const std::vector<E>& expected, const std::string& what) {
    INFO(what);
    REQUIRE(actual.size() == expected.size());
    std::size_t bad = actual.size();
    for (std::size_t i = 0; i < actual.size() && bad == actual.size(); ++i)
        if (static_cast<std::int64_t>(actual[i]) != static_cast<std::int64_t>(expected[i])) bad = i;
    // the message is built only on failure (doctest evaluates it lazily), when `bad` is valid
    CHECK_MESSAGE(bad == actual.size(), "first difference at element " << bad << ": actual "
                                                                       << static_cast<std::int64_t>(actual[bad]) << ", expected "
                                                                       << static_cast<std::int64_t>(expected[bad]));
}

/// The golden README's rule: |a − e| ≤ atol + rtol·|e| elementwise. One CHECK per array, naming the
/// worst element (largest |a − e| / bound); NaN in `actual` fails.
template <class S>
void check_close(const std::vector<S>& actual, const std::vector<double>& expected, double atol, double rtol,
                 const std::string& what) {
    INFO(what << " (atol " << atol << ", rtol " << rtol << ")");
    REQUIRE(actual.size() == expected.size());
    double worst = 0;
    std::size_t worst_i = 0;
    bool ok = true;
    for (std::size_t i = 0; i < actual.size(); ++i) {
        const double a = static_cast<double>(actual[i]), e = expected[i];
        const double bound = atol + rtol * std::fabs(e);
        const double ratio = std::fabs(a - e) / bound;
        if (!(ratio <= 1.0)) ok = false;
        if (!(ratio <= worst)) {  // also catches NaN
            worst = std::isnan(ratio) ? std::numeric_limits<double>::infinity() : ratio;
            worst_i = i;
        }
    }
    std::ostringstream os;
    os.precision(10);
    if (!actual.empty())
        os << "worst element " << worst_i << ": actual " << static_cast<double>(actual[worst_i]) << ", expected "
           << expected[worst_i] << ", |diff|/tolerance " << worst;
    INFO(os.str());
    CHECK(ok);
}

/// Compares `actual` with the golden file `key` of case `dir` under the tolerance of `meta`
/// (meta.json): float uses `key` with atol_float32 / rtol_float32; double uses the `_f64` twin
/// with atol_float64 / rtol_float64 (the README's rule). Json is nlohmann::json (a template
/// parameter so that this header does not include it).
template <class S, class Json>
void check_golden(const std::string& dir, const Json& meta, const std::string& key, const std::vector<S>& actual) {
    const auto& tol = meta.at("tolerance");
    const auto& per = tol.at("per_file").at(key);
    if constexpr (std::is_same_v<S, double>) {
        const std::string f64 = key.substr(0, key.size() - 4) + "_f64.npy";
        check_close(actual, load<double>(dir, f64), per.at("atol_float64").template get<double>(),
                    tol.at("rtol_float64").template get<double>(), dir + "/" + f64 + " (double)");
    } else {
        check_close(actual, load<double>(dir, key), per.at("atol_float32").template get<double>(),
                    tol.at("rtol_float32").template get<double>(), dir + "/" + key + " (float)");
    }
}

/// Runs `f`, expecting it to throw E; returns what() (and fails a check with "" otherwise).
template <class E, class F>
std::string error_of(F&& f) {
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

/// True when `f` throws E whose message contains every one of `parts` (the parameter name and
/// value, e.g. "beta = 1"); the message is logged on failure.
template <class E = rpe::invalid_argument, class F>
bool throws_with(F&& f, std::initializer_list<const char*> parts) {
    const std::string what = error_of<E>(std::forward<F>(f));
    bool ok = !what.empty();
    for (const char* p : parts) ok = ok && what.find(p) != std::string::npos;
    if (!ok) MESSAGE("message: \"" << what << "\"");
    return ok;
}
template <class E = rpe::invalid_argument, class F>
bool throws_with(F&& f, const char* part) {
    return throws_with<E>(std::forward<F>(f), {part});
}

/// `n` values N(0, sigma²) from a fixed seed.
template <class S>
std::vector<S> random_normal(std::size_t n, unsigned seed, double sigma = 1.0) {
    std::mt19937 gen(seed);
    std::normal_distribution<double> dist(0.0, sigma);
    std::vector<S> v(n);
    for (auto& e : v) e = static_cast<S>(dist(gen));
    return v;
}

/// Random (B, H, L, L) attention probabilities: each row a softmax of N(0, 1) logits.
template <class S>
std::vector<S> random_softmax_rows(std::int64_t rows, std::int64_t n, unsigned seed) {
    auto v = random_normal<S>(static_cast<std::size_t>(rows * n), seed);
    for (std::int64_t r = 0; r < rows; ++r) {
        S sum = 0;
        for (std::int64_t j = 0; j < n; ++j)
            sum += (v[static_cast<std::size_t>(r * n + j)] = std::exp(v[static_cast<std::size_t>(r * n + j)]));
        for (std::int64_t j = 0; j < n; ++j) v[static_cast<std::size_t>(r * n + j)] /= sum;
    }
    return v;
}

/// Largest |a − b| over two arrays of equal size.
template <class A, class B>
double max_abs_diff(const std::vector<A>& a, const std::vector<B>& b) {
    REQUIRE(a.size() == b.size());
    double m = 0;
    for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    return m;
}

/// A random problem for one term type (rpe::term<...>): ids built without the cache, N(0, 0.5²)
/// tables, N(0, 1) x (a softmax for the value target, none for bias) and grad_out, in the
/// reference's shapes. Bias output is (1, Ht, L, L); a test may set another broadcast `oshape`
/// (then it also regenerates `grad_out`).
template <class Term>
struct term_problem {
    using S = typename Term::scalar_type;
    static constexpr int nt = Term::num_tables;
    Term term;
    std::shared_ptr<const rpe::bucket_ids> ids;
    std::int64_t b, h, l, d;
    std::vector<std::int64_t> tshape, xshape, oshape;
    std::vector<std::vector<S>> tables;  // one per table
    std::vector<S> x, grad_out;

    term_problem(Term t, int batch, int height, int width, unsigned seed)
        : term(std::move(t)),
          ids(rpe::build_bucket_ids(term.mapping(), height, width, term.skip())),
          b(batch),
          h(term.num_heads()),
          l(ids->length()),
          d(term.head_dim()),
          tshape(term.table_shape()) {
        std::size_t tsize = 1;
        for (auto e : tshape) tsize *= static_cast<std::size_t>(e);
        for (int i = 0; i < nt; ++i) tables.push_back(random_normal<S>(tsize, seed + 1 + static_cast<unsigned>(i), 0.5));
        if constexpr (Term::is_bias) {
            oshape = {1, term.table_heads(), l, l};
        } else if constexpr (Term::target_kind == rpe::target::value) {
            xshape = {b, h, l, l};
            oshape = {b, h, l, d};
            x = random_softmax_rows<S>(b * h * l, l, seed + 10);
        } else {
            xshape = {b, h, l, d};
            oshape = {b, h, l, l};
            x = random_normal<S>(static_cast<std::size_t>(b * h * l * d), seed + 10);
        }
        grad_out = random_normal<S>(static_cast<std::size_t>(out_size()), seed + 20);
    }
    [[nodiscard]] std::int64_t out_size() const {
        std::int64_t n = 1;
        for (auto e : oshape) n *= e;
        return n;
    }
    [[nodiscard]] typename Term::tables_type table_refs() const {
        typename Term::tables_type r;
        for (int i = 0; i < nt; ++i) r[static_cast<std::size_t>(i)] = cview(tables[static_cast<std::size_t>(i)], tshape);
        return r;
    }
    /// Views of `g` (resized to the tables' sizes) as gradient buffers.
    typename Term::grad_tables_type grad_refs(std::vector<std::vector<S>>& g) const {
        g.resize(static_cast<std::size_t>(nt));
        typename Term::grad_tables_type r;
        for (int i = 0; i < nt; ++i) {
            g[static_cast<std::size_t>(i)].resize(tables[static_cast<std::size_t>(i)].size());
            r[static_cast<std::size_t>(i)] = mview(g[static_cast<std::size_t>(i)], tshape);
        }
        return r;
    }
    [[nodiscard]] rpe::tensor_ref<const S> x_ref() const {
        return xshape.empty() ? rpe::tensor_ref<const S>{} : cview(x, xshape);
    }
    /// Forward into a fresh (overwritten) buffer of the output shape.
    [[nodiscard]] std::vector<S> forward() const {
        std::vector<S> out(static_cast<std::size_t>(out_size()));
        term.forward(*ids, table_refs(), x_ref(), mview(out, oshape), rpe::write::overwrite);
        return out;
    }
};

/// The parsed meta.json of golden case folder `dir` (Json is nlohmann::json: a template parameter
/// so that this header does not include it).
template <class Json>
Json read_meta(const std::string& dir) {
    std::ifstream f(dir + "/meta.json");
    REQUIRE(f.good());
    return Json::parse(f);
}

/// The folder of rotary golden case `name`: tests/data/golden_vit/rope/<name>.
inline std::string rope_golden_dir(const std::string& name) {
    return std::string(RPE_TEST_DATA_DIR) + "/golden_vit/rope/" + name;
}

/// Central difference of `objective()` along entry i of `param`:
/// (f(param + eps·e_i) − f(param − eps·e_i)) / (2·eps); param[i] is restored.
template <class F>
double central_difference(std::vector<double>& param, std::size_t i, double eps, F&& objective) {
    const double saved = param[i];
    param[i] = saved + eps;
    const double up = objective();
    param[i] = saved - eps;
    const double down = objective();
    param[i] = saved;
    return (up - down) / (2 * eps);
}

}  // namespace rpe_test
