// rpe_conformance DIR: runs every golden case (any folder holding a meta.json, searched
// recursively) through the library in float32 and float64 and prints one line per case:
//   PASS <case path> max_abs=<e> worst_tol_ratio=<r>
//   FAIL <case path> <what differed>
// then `N passed, M failed`. Exit status 0 only when M == 0 and N > 0.
// Kinds: index, bucket_ids, term, attention (through rpe::composed_attention_* and through the
// fused rpe::attention_forward / attention_backward, both checked), error.
// The format is documented in tests/data/golden/README.md.
#include <rpe/io/npy.hpp>
#include <rpe/rpe.hpp>
#include <rpe/make_term.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <span>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

/// A comparison failure: the case FAILs with this text.
struct mismatch : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct score {
    double max_abs = 0;      // largest |actual - expected| over every compared element
    double worst_ratio = 0;  // largest |actual - expected| / (atol + rtol |expected|)
};

class case_runner {
public:
    case_runner(fs::path dir, json meta) : dir_(std::move(dir)), meta_(std::move(meta)) {}

    score run() {
        const std::string kind = meta_.at("kind").get<std::string>();
        if (kind == "index")
            run_index();
        else if (kind == "bucket_ids")
            run_bucket_ids();
        else if (kind == "term") {
            run_term<float>();
            run_term<double>();
        } else if (kind == "attention") {
            for (bool fused : {false, true}) {
                run_attention<float>(fused);
                run_attention<double>(fused);
            }
        } else if (kind == "error")
            run_error();
        else
            throw mismatch("unknown kind '" + kind + "'");
        return score_;
    }

private:
    rpe::io::npy_array load(const std::string& file) const { return rpe::io::load_npy((dir_ / file).string()); }

    template <class T>
    std::vector<T> load_as(const std::string& file, const std::vector<std::int64_t>& shape) const {
        const auto a = load(file);
        if (a.shape != shape)
            throw mismatch(file + " has shape " + rpe::detail::shape_string(a.shape) + "; expected " +
                           rpe::detail::shape_string(shape));
        return a.to<T>();
    }

    void exact(const std::string& file, const std::vector<int>& actual) {
        const auto expected = load(file).to<std::int64_t>();
        if (expected.size() != actual.size())
            throw mismatch(file + ": " + std::to_string(actual.size()) + " values computed, " + std::to_string(expected.size()) +
                           " expected");
        for (std::size_t i = 0; i < actual.size(); ++i)
            if (expected[i] != actual[i]) {
                std::ostringstream os;
                os << file << ": element " << i << " is " << actual[i] << ", expected " << expected[i];
                throw mismatch(os.str());
            }
    }

    // Compares `actual` (precision S) with the reference file for `key` (the float32 file name,
    // which also keys the tolerance) under the rule of the golden README.
    template <class S>
    void close(const std::string& key, const std::vector<S>& actual) {
        const auto& tol = meta_.at("tolerance");
        const auto& per = tol.at("per_file").at(key);
        std::string file = key;
        double atol = per.at("atol_float32").get<double>(), rtol = tol.at("rtol_float32").get<double>();
        if constexpr (std::is_same_v<S, double>) {
            const std::string f64 = key.substr(0, key.size() - 4) + "_f64.npy";
            if (fs::exists(dir_ / f64)) {
                file = f64;
                atol = per.at("atol_float64").get<double>();
                rtol = tol.at("rtol_float64").get<double>();
            }
        }
        const auto expected = load(file).to<double>();
        if (expected.size() != actual.size())
            throw mismatch(file + ": " + std::to_string(actual.size()) + " values computed, " + std::to_string(expected.size()) +
                           " expected");
        for (std::size_t i = 0; i < actual.size(); ++i) {
            const double a = static_cast<double>(actual[i]), e = expected[i];
            const double diff = std::fabs(a - e), bound = atol + rtol * std::fabs(e);
            if (!(diff <= bound)) {
                std::ostringstream os;
                os.precision(9);
                os << file << " (" << (sizeof(S) == 4 ? "float32" : "float64") << "): element " << i << " is " << a
                   << ", expected " << e << ", |diff| " << diff << " > tolerance " << bound;
                throw mismatch(os.str());
            }
            score_.max_abs = std::max(score_.max_abs, diff);
            score_.worst_ratio = std::max(score_.worst_ratio, diff / bound);
        }
    }

    rpe::term_spec spec(const std::string& target) const {
        rpe::term_spec s;
        s.method = rpe::parse_method(meta_.at("method").get<std::string>());
        s.contextual = rpe::parse_contextual(meta_.value("mode", std::string("contextual")));
        s.target = rpe::parse_target(target);
        s.alpha = meta_.at("alpha").get<double>();
        s.beta = meta_.at("beta").get<double>();
        s.gamma = meta_.at("gamma").get<double>();
        s.shared_head = meta_.value("shared_head", true);
        s.skip = meta_.value("skip", 0);
        s.num_heads = meta_.value("heads", 1);
        s.head_dim = meta_.value("head_dim", 1);
        return s;
    }

    void check_num_buckets(const rpe::term_spec& s) const {
        if (meta_.contains("num_buckets") && s.num_buckets() != meta_.at("num_buckets").get<int>())
            throw mismatch("num_buckets " + std::to_string(s.num_buckets()) + ", expected " +
                           std::to_string(meta_.at("num_buckets").get<int>()));
    }

    // Checks our ids against every bucket_ids*.npy named in `tables` (list of {bucket_ids: file}).
    void check_ids(const rpe::bucket_ids& ids, const json& tables) {
        for (std::size_t t = 0; t < tables.size(); ++t) {
            const int n = ids.length();
            std::vector<int> v(static_cast<std::size_t>(n) * n);
            for (int i = 0; i < n; ++i)
                for (int j = 0; j < n; ++j) v[static_cast<std::size_t>(i) * n + j] = ids.at(static_cast<int>(t), i, j);
            exact(tables[t].at("bucket_ids").get<std::string>(), v);
        }
    }

    void run_index() {
        const rpe::index::piecewise g{meta_.at("alpha").get<double>(), meta_.at("beta").get<double>(),
                                      meta_.at("gamma").get<double>()};
        g.validate();
        for (const auto& c : meta_.at("compare")) {
            const std::string input = c.at("inputs").at(0).get<std::string>();
            const auto in = load(input);
            std::vector<int> out;
            if (in.is_float())
                for (float x : in.to<float>()) out.push_back(g(x));
            else
                for (std::int64_t x : in.to<std::int64_t>()) out.push_back(g(x));
            exact(c.at("expected").get<std::string>(), out);
        }
    }

    void run_bucket_ids() {
        auto s = spec("k");
        check_num_buckets(s);
        const auto term = rpe::make_term<float>(s);
        const auto ids = term->bucket_ids(meta_.at("height").get<int>(), meta_.at("width").get<int>());
        json tables = json::array();
        for (const auto& c : meta_.at("compare")) tables.push_back({{"bucket_ids", c.at("expected")}});
        check_ids(*ids, tables);
    }

    template <class S>
    void run_term() {
        const std::string letter = meta_.at("target").get<std::string>();
        const auto s = spec(letter);
        check_num_buckets(s);
        const auto term = rpe::make_term<S>(s);
        const int height = meta_.at("height").get<int>(), width = meta_.at("width").get<int>();
        const auto ids = term->bucket_ids(height, width);
        const json& tables = meta_.at("tables");
        check_ids(*ids, tables);
        const std::int64_t b = meta_.at("batch").get<std::int64_t>(), h = s.num_heads, l = ids->length(), d = s.head_dim;
        const std::vector<std::int64_t> tshape = term->table_shape();
        std::vector<std::vector<S>> tab, grad_tab;
        for (const auto& t : tables) {
            tab.push_back(load_as<S>(t.at("table").get<std::string>(), tshape));
            grad_tab.emplace_back(tab.back().size());
        }
        std::vector<rpe::tensor_ref<const S>> tab_refs;
        std::vector<rpe::tensor_ref<S>> grad_refs;
        auto view = [](auto* p, const std::vector<std::int64_t>& sh) {
            using T = std::remove_pointer_t<decltype(p)>;
            return rpe::tensor_ref<T>(p, std::span<const std::int64_t>(sh));
        };
        for (std::size_t t = 0; t < tab.size(); ++t) {
            tab_refs.push_back(view(static_cast<const S*>(tab[t].data()), tshape));
            grad_refs.push_back(view(grad_tab[t].data(), tshape));
        }
        std::vector<std::int64_t> xshape, oshape;
        if (!s.contextual) {
            oshape = {1, tshape[0], l, l};
        } else if (s.target == rpe::target::value) {
            xshape = {b, h, l, l};
            oshape = {b, h, l, d};
        } else {
            xshape = {b, h, l, d};
            oshape = {b, h, l, l};
        }
        std::vector<S> x, grad_x;
        if (!xshape.empty()) {
            x = load_as<S>("x.npy", xshape);
            grad_x.resize(x.size());
        }
        const auto grad_out = load_as<S>("grad_output.npy", oshape);
        std::vector<S> out(grad_out.size());
        const auto x_ref = xshape.empty() ? rpe::tensor_ref<const S>{} : view(static_cast<const S*>(x.data()), xshape);
        term->forward(*ids, tab_refs, x_ref, view(out.data(), oshape), rpe::write::overwrite);
        term->backward(*ids, tab_refs, x_ref, view(grad_out.data(), oshape),
                       xshape.empty() ? rpe::tensor_ref<S>{} : view(grad_x.data(), xshape), grad_refs, rpe::write::overwrite);
        close("output.npy", out);
        if (!xshape.empty()) close("grad_input.npy", grad_x);
        for (std::size_t t = 0; t < tables.size(); ++t) close(tables[t].at("grad").get<std::string>(), grad_tab[t]);
    }

    // The attention step through rpe::composed_attention_* (fused = false) or the fused
    // rpe::attention_forward / attention_backward (fused = true, with a small row block so that
    // several blocks per head are exercised).
    template <class S>
    void run_attention(bool fused) {
        const std::string on = meta_.at("rpe_on").get<std::string>();
        if (on.find_first_not_of("qkv") != std::string::npos)
            throw std::runtime_error("meta.json: rpe_on = '" + on + "'; expected letters among q, k, v");
        const std::int64_t b = meta_.at("batch").get<std::int64_t>(), h = meta_.at("heads").get<std::int64_t>(),
                           l = meta_.at("L").get<std::int64_t>(), d = meta_.at("head_dim").get<std::int64_t>();
        const std::vector<std::int64_t> qshape{b, h, l, d};
        const auto q = load_as<S>("q.npy", qshape), k = load_as<S>("k.npy", qshape), v = load_as<S>("v.npy", qshape);
        const auto grad_out = load_as<S>("grad_output.npy", qshape);
        rpe::attention_inputs<S> in;
        in.q = rpe::tensor_ref<const S>(q.data(), {b, h, l, d});
        in.k = rpe::tensor_ref<const S>(k.data(), {b, h, l, d});
        in.v = rpe::tensor_ref<const S>(v.data(), {b, h, l, d});
        in.height = meta_.at("height").get<int>();
        in.width = meta_.at("width").get<int>();
        std::vector<std::uint8_t> mask;
        if (meta_.value("key_padding_mask", false)) {
            mask = load_as<std::uint8_t>("key_padding_mask.npy", {b, l});
            in.key_padding_mask = rpe::tensor_ref<const std::uint8_t>(mask.data(), {b, l});
        }
        std::unique_ptr<rpe::any_term<S>> terms[3];
        std::vector<std::vector<S>> tables, grads;
        tables.reserve(6);
        grads.reserve(6);
        std::vector<std::pair<std::string, std::vector<S>*>> grad_files;
        const char letters[3] = {'q', 'k', 'v'};
        rpe::attention_term<S>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        for (int t = 0; t < 3; ++t) {
            if (on.find(letters[t]) == std::string::npos) continue;
            const auto s = spec(std::string(1, letters[t]));
            check_num_buckets(s);
            terms[t] = rpe::make_term<S>(s);
            slots[t]->term = terms[t].get();
            const auto shape = terms[t]->table_shape();
            const json& list = meta_.at("rpe").at(std::string(1, letters[t])).at("tables");
            check_ids(*terms[t]->bucket_ids(in.height, in.width), list);
            for (const auto& e : list) {
                tables.push_back(load_as<S>(e.at("table").get<std::string>(), shape));
                grads.emplace_back(tables.back().size());
                rpe::tensor_ref<const S> tr;
                rpe::tensor_ref<S> gr;
                tr.data = tables.back().data();
                gr.data = grads.back().data();
                tr.rank = gr.rank = static_cast<int>(shape.size());
                for (std::size_t i = 0; i < shape.size(); ++i) tr.shape[i] = gr.shape[i] = shape[i];
                slots[t]->tables.push_back(tr);
                slots[t]->grad_tables.push_back(gr);
                grad_files.emplace_back(e.at("grad").get<std::string>(), &grads.back());
            }
        }
        std::vector<S> out(q.size()), attn(static_cast<std::size_t>(b * h * l * l));
        std::vector<S> gq(q.size()), gk(q.size()), gv(q.size());
        const rpe::tensor_ref<S> out_ref(out.data(), {b, h, l, d}), attn_ref(attn.data(), {b, h, l, l});
        const rpe::tensor_ref<const S> grad_out_ref(grad_out.data(), {b, h, l, d});
        const rpe::tensor_ref<S> gq_ref(gq.data(), {b, h, l, d}), gk_ref(gk.data(), {b, h, l, d}),
            gv_ref(gv.data(), {b, h, l, d});
        if (fused) {
            const rpe::attention_options opt{.row_block = 7};
            rpe::attention_forward(in, out_ref, attn_ref, opt);
            rpe::attention_backward(in, grad_out_ref, gq_ref, gk_ref, gv_ref, opt);
        } else {
            rpe::composed_attention_forward(in, out_ref, attn_ref);
            rpe::composed_attention_backward(in, {.grad_out = grad_out_ref,
                                                  .grad_q = gq_ref,
                                                  .grad_k = gk_ref,
                                                  .grad_v = gv_ref,
                                                  .saved_attn = rpe::tensor_ref<const S>(attn_ref)});
        }
        close("output.npy", out);
        close("attn.npy", attn);
        close("grad_q.npy", gq);
        close("grad_k.npy", gk);
        close("grad_v.npy", gv);
        for (const auto& [file, g] : grad_files) close(file, *g);
    }

    void run_error() {
        auto s = spec(meta_.at("target").get<std::string>());
        try {
            (void)rpe::make_term<float>(s);
        } catch (const rpe::invalid_argument&) {
            return;
        } catch (const rpe::out_of_range&) {
            return;
        }
        throw mismatch("the call was accepted; expected an rpe exception (" + meta_.value("what", std::string("error case")) +
                       ")");
    }

    fs::path dir_;
    json meta_;
    score score_;
};

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::cerr << "usage: rpe_conformance DIR\n  runs every case (folder with a meta.json) under DIR\n";
        return 2;
    }
    const fs::path root = argv[1];
    std::vector<fs::path> cases;
    std::error_code ec;
    if (fs::exists(root / "meta.json", ec)) cases.push_back(root);
    if (fs::is_directory(root, ec))
        for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::skip_permission_denied, ec);
             !ec && it != fs::recursive_directory_iterator(); it.increment(ec))
            if (it->is_directory(ec) && fs::exists(it->path() / "meta.json", ec)) cases.push_back(it->path());
    std::sort(cases.begin(), cases.end());
    int passed = 0, failed = 0;
    for (const auto& dir : cases) {
        const std::string name = dir.generic_string();
        try {
            std::ifstream f(dir / "meta.json");
            const json meta = json::parse(f);
            const score s = case_runner(dir, meta).run();
            std::printf("PASS %s max_abs=%.3g worst_tol_ratio=%.3g\n", name.c_str(), s.max_abs, s.worst_ratio);
            ++passed;
        } catch (const std::exception& e) {
            std::string what = e.what();
            std::replace(what.begin(), what.end(), '\n', ' ');
            std::printf("FAIL %s %s\n", name.c_str(), what.c_str());
            ++failed;
        }
        std::fflush(stdout);
    }
    if (cases.empty()) std::printf("no case (folder with a meta.json) found under %s\n", root.string().c_str());
    std::printf("%d passed, %d failed\n", passed, failed);
    return (failed == 0 && passed > 0) ? 0 : 1;
}
