// Reads the golden term and attention cases for the CUDA tests (format: tests/data/golden/README.md;
// the same rules as tools/conformance/main.cpp).
#include "golden_cases.hpp"

#include <rpe/io/npy.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>

namespace rpe_cuda_test {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::vector<fs::path> case_dirs(const fs::path& root) {
    std::vector<fs::path> dirs;
    if (!fs::is_directory(root)) return dirs;
    for (const auto& e : fs::directory_iterator(root))
        if (e.is_directory() && fs::exists(e.path() / "meta.json")) dirs.push_back(e.path());
    std::sort(dirs.begin(), dirs.end());
    return dirs;
}

template <class T>
std::vector<T> load(const fs::path& dir, const std::string& file, std::vector<std::int64_t>* shape = nullptr) {
    const auto a = rpe::io::load_npy((dir / file).string());
    if (shape) *shape = a.shape;
    return a.to<T>();
}

expected_array expected(const fs::path& dir, const json& meta, const std::string& file) {
    expected_array e;
    e.file = file;
    e.values = load<double>(dir, file, &e.shape);
    e.atol = meta.at("tolerance").at("per_file").at(file).at("atol_float32").get<double>();
    e.rtol = meta.at("tolerance").at("rtol_float32").get<double>();
    return e;
}

}  // namespace

std::vector<term_case> load_term_cases(const std::string& golden_dir) {
    std::vector<term_case> cases;
    for (const auto& dir : case_dirs(fs::path(golden_dir) / "term")) {
        std::ifstream f(dir / "meta.json");
        const json meta = json::parse(f);
        term_case c;
        c.name = dir.filename().string();
        c.method = meta.at("method").get<std::string>();
        c.contextual = meta.value("mode", std::string("contextual")) != "bias";
        c.target = meta.at("target").get<std::string>().at(0);
        c.alpha = meta.at("alpha").get<double>();
        c.beta = meta.at("beta").get<double>();
        c.gamma = meta.at("gamma").get<double>();
        c.shared_head = meta.value("shared_head", true);
        c.skip = meta.value("skip", 0);
        c.heads = meta.value("heads", 1);
        c.head_dim = meta.value("head_dim", 1);
        c.height = meta.at("height").get<int>();
        c.width = meta.at("width").get<int>();
        c.batch = meta.at("batch").get<int>();
        for (const auto& t : meta.at("tables")) {
            c.tables.push_back(load<float>(dir, t.at("table").get<std::string>(), &c.table_shape));
            c.grad_tables.push_back(expected(dir, meta, t.at("grad").get<std::string>()));
        }
        if (c.contextual) {
            c.x = load<float>(dir, "x.npy", &c.x_shape);
            c.grad_x = expected(dir, meta, "grad_input.npy");
        }
        c.grad_out = load<float>(dir, "grad_output.npy", &c.out_shape);
        c.out = expected(dir, meta, "output.npy");
        cases.push_back(std::move(c));
    }
    return cases;
}

std::vector<attention_case> load_attention_cases(const std::string& golden_dir) {
    std::vector<attention_case> cases;
    for (const auto& dir : case_dirs(fs::path(golden_dir) / "attention")) {
        std::ifstream f(dir / "meta.json");
        const json meta = json::parse(f);
        attention_case c;
        c.name = dir.filename().string();
        c.rpe_on = meta.at("rpe_on").get<std::string>();
        c.method = meta.at("method").get<std::string>();
        c.contextual = meta.value("mode", std::string("contextual")) != "bias";
        c.alpha = meta.at("alpha").get<double>();
        c.beta = meta.at("beta").get<double>();
        c.gamma = meta.at("gamma").get<double>();
        c.shared_head = meta.value("shared_head", true);
        c.skip = meta.value("skip", 0);
        c.heads = meta.at("heads").get<int>();
        c.head_dim = meta.at("head_dim").get<int>();
        c.height = meta.at("height").get<int>();
        c.width = meta.at("width").get<int>();
        c.batch = meta.at("batch").get<int>();
        c.length = meta.at("L").get<int>();
        c.q = load<float>(dir, "q.npy");
        c.k = load<float>(dir, "k.npy");
        c.v = load<float>(dir, "v.npy");
        c.grad_out = load<float>(dir, "grad_output.npy");
        if (meta.value("key_padding_mask", false)) c.key_padding_mask = load<std::uint8_t>(dir, "key_padding_mask.npy");
        const char letters[3] = {'q', 'k', 'v'};
        for (int s = 0; s < 3; ++s) {
            if (c.rpe_on.find(letters[s]) == std::string::npos) continue;
            for (const auto& e : meta.at("rpe").at(std::string(1, letters[s])).at("tables")) {
                c.tables[s].push_back(load<float>(dir, e.at("table").get<std::string>()));
                c.grad_tables[s].push_back(expected(dir, meta, e.at("grad").get<std::string>()));
            }
        }
        c.out = expected(dir, meta, "output.npy");
        c.grad_q = expected(dir, meta, "grad_q.npy");
        c.grad_k = expected(dir, meta, "grad_k.npy");
        c.grad_v = expected(dir, meta, "grad_v.npy");
        cases.push_back(std::move(c));
    }
    return cases;
}

}  // namespace rpe_cuda_test
