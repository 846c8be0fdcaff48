/// @file registry.hpp
/// @brief The one registry of term families by name: rpe::family_spec (a family and its
/// parameters, parsed from and printed to text), rpe::family_info (what a family takes) and
/// rpe::registry (the built-in families of <rpe/families.hpp> and the families a program adds,
/// e.g. a user's own mapping policy through RPE_REGISTER_MAPPING).
///
/// Text form of a spec: `family[:param=value[,param=value...]]`, e.g. `product`,
/// `product:index=clip,beta=4`, `t5_causal`, `swin:window_h=7,window_w=7`. rpe::to_string prints
/// every parameter, so `parse_family_spec(to_string(s)) == s`.
///
/// One instance per process: rpe::registry::global() is an inline function with default
/// visibility, so its static is merged by the dynamic linker across the program and every shared
/// library loaded into it (the `rpe` tool's --plugin, torch.ops.load_library), whatever
/// -fvisibility the units are built with. The families hold std::function and std::string:
/// the program and its plugins must be built by the same C++ standard library.
#pragma once

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "error.hpp"
#include "mode.hpp"

namespace rpe {

template <class S>
class any_term;
class bucket_ids;

/// @brief One parameter of a family: its name, kind, default and (choice) its values.
struct family_param {
    /// @brief What values the parameter takes.
    enum class kind {
        number,   ///< any finite double
        integer,  ///< an integer in [−2^30, 2^30]
        flag,     ///< 0 or 1 (text: true/false, 1/0)
        choice,   ///< one of `choices` (stored as its position)
    };
    std::string name{};                  ///< e.g. "alpha"
    kind type = kind::number;            ///< its kind
    double default_value = 0;            ///< the value when the text does not set it
    std::vector<std::string> choices{};  ///< choice: the names, in order
    std::string help{};                  ///< one line for --help and docs

    /// @brief A number parameter.
    static family_param number(std::string name, double def, std::string help = {}) {
        return {std::move(name), kind::number, def, {}, std::move(help)};
    }
    /// @brief An integer parameter.
    static family_param integer(std::string name, int def, std::string help = {}) {
        return {std::move(name), kind::integer, static_cast<double>(def), {}, std::move(help)};
    }
    /// @brief A flag (0 / 1).
    static family_param flag(std::string name, bool def, std::string help = {}) {
        return {std::move(name), kind::flag, def ? 1.0 : 0.0, {}, std::move(help)};
    }
    /// @brief A choice among `choices` (default: the first).
    static family_param choice(std::string name, std::vector<std::string> choices, std::string help = {}) {
        return {std::move(name), kind::choice, 0.0, std::move(choices), std::move(help)};
    }
};

/// @brief What a family is: a mapping of offsets to buckets (terms, bucket ids) or a RoPE form.
enum class family_kind { mapping, rope };

/// @brief Another name of a family, with parameters it presets (e.g. `t5_causal` = t5 with
/// bidirectional = 0; `euc` = euclidean).
struct family_alias {
    std::string name{};                                     ///< the alias
    std::vector<std::pair<std::string, double>> presets{};  ///< parameters it sets
};

/// @brief The grid a mapping is built for; 0 × 0 when not known yet. A family whose mapping
/// depends on the grid (swin's default window, decomposed's β) reads it.
struct grid_extent {
    int height = 0;  ///< rows
    int width = 0;   ///< columns
};

/// @brief The modes and targets a family's terms take (decomposed: contextual on k; alibi2d: bias
/// on k with a generated table; the iRPE mappings: all).
struct family_terms {
    bool bias = true;        ///< bias mode allowed
    bool contextual = true;  ///< contextual mode allowed
    bool key_only = false;   ///< only target k
};

/// @brief A family's description: name, aliases, parameters, kind, group.
struct family_info {
    std::string name{};                       ///< canonical name, e.g. "product"
    std::vector<family_alias> aliases{};      ///< other names (the reference's "euc", "quant", ...)
    std::vector<family_param> params{};       ///< parameters, in order (the positional order of the torch ops)
    std::string summary{};                    ///< one line for messages and --help
    family_kind kind = family_kind::mapping;  ///< mapping or RoPE form
    std::string group{};   ///< "irpe" (the reference's four 2D mappings), "irpe_paper", "1d", "3d", "vit", "rope", "user"
    family_terms terms{};  ///< modes and targets of its terms
    int num_tables = 1;    ///< tables per term (cross, decomposed: 2)
};

/// @brief A family and the value of each of its parameters (every one, in the family's order).
///
/// Equality compares the family and the values; a spec from rpe::parse_family_spec holds every
/// parameter of its family, defaults included.
struct family_spec {
    std::string family{};                                  ///< canonical family name
    std::vector<std::pair<std::string, double>> params{};  ///< (name, value), the family's order

    /// @brief The value of parameter `name`.
    /// @throws rpe::invalid_argument `[rpe.term_spec] parameter = '...' of <family>; expected one of ...`.
    [[nodiscard]] double get(std::string_view name) const {
        for (const auto& [n, v] : params)
            if (n == name) return v;
        throw invalid_argument(
            detail::message("term_spec", "parameter = '", name, "' of ", family, "; expected one of ", names()));
    }
    /// @brief The value of an integer parameter, as int.
    [[nodiscard]] int get_int(std::string_view name) const { return static_cast<int>(get(name)); }
    /// @brief Whether the family has parameter `name`.
    [[nodiscard]] bool has(std::string_view name) const {
        return std::any_of(params.begin(), params.end(), [&](const auto& p) { return p.first == name; });
    }
    /// @brief Sets parameter `name` (unchecked: rpe::registry::set_param checks the value).
    /// @throws as get() for a parameter the family does not have.
    family_spec& set(std::string_view name, double value) {
        for (auto& [n, v] : params)
            if (n == name) {
                v = value;
                return *this;
            }
        (void)get(name);  // throws, naming the parameters
        return *this;
    }
    /// @brief The parameter names, comma-separated ("none" when there are none).
    [[nodiscard]] std::string names() const {
        std::string s;
        for (const auto& [n, v] : params) s += (s.empty() ? "" : ", ") + n;
        return s.empty() ? std::string("none") : s;
    }
    friend bool operator==(const family_spec&, const family_spec&) = default;
};

namespace detail {

/// Shortest text that reads back as the same double (std::to_chars).
inline std::string number_text(double v) {
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);
    return std::string(buf, r.ptr);
}

}  // namespace detail

/// @brief Families by name: the built-ins (added by <rpe/families.hpp> on first use) and the
/// families a program or plugin adds. Thread-safe; one instance per process (see the file comment).
class registry {
public:
    /// @brief A family added at run time by a program (a user's mapping): its description and its
    /// operations, instantiated for its mapping type where it was added (rpe::register_mapping).
    struct entry {
        family_info info{};  ///< name, aliases, parameters
        /// bucket ids of the mapping of `spec` on a depth × height × width grid (rpe::build_bucket_ids, no cache)
        std::function<std::shared_ptr<const bucket_ids>(const family_spec&, grid_extent, int depth, int skip)> build_ids;
        /// the run-time term (float) of the mapping of `spec`
        std::function<std::unique_ptr<any_term<float>>(const family_spec&, grid_extent, bool contextual, target, int heads,
                                                       int head_dim, bool shared_head, int skip)>
            term_f32;
        /// the same in double
        std::function<std::unique_ptr<any_term<double>>(const family_spec&, grid_extent, bool contextual, target, int heads,
                                                        int head_dim, bool shared_head, int skip)>
            term_f64;
        /// the mapping's num_buckets() (without the skip bucket), which also validates the parameters
        std::function<std::int64_t(const family_spec&, grid_extent)> num_buckets;
        /// a built-in family's position in <rpe/families.hpp> (its operations are compiled into
        /// the visitor there); -1 for a family added at run time
        int builtin = -1;
        /// true when the family's mapping is 3D (rpe::Mapping3D: positions (N, 3) (t, row, col))
        bool mapping_3d = false;
    };

    /// @brief Runs `add(*this)` once per process (<rpe/families.hpp> adds the built-ins so).
    void ensure(void (*add)(registry&)) { std::call_once(builtins_once_, add, *this); }

    /// @brief The process-wide registry. Default visibility on purpose: one instance across shared
    /// libraries (a plugin's families are seen by the program that loads it).
    [[gnu::visibility("default")]] static registry& global() {
        static registry r;
        return r;
    }

    /// @brief Adds a family (a built-in's info without operations, or a user's entry).
    /// @throws rpe::invalid_argument `[rpe.registry] name = '...'; already registered` when the name
    ///   or an alias is taken, or is empty or holds ':', ',', '=' or a space.
    void add(entry e) {
        const std::lock_guard<std::mutex> lock(mutex_);
        std::vector<std::string> names{e.info.name};
        for (const auto& a : e.info.aliases) names.push_back(a.name);
        for (const auto& n : names) {
            detail::require(!n.empty() && n.find_first_of(":,= ") == std::string::npos, "registry", "name = '", n,
                            "'; expected a non-empty name without ':', ',', '=' or spaces");
            detail::require(find_locked(n) == nullptr, "registry", "name = '", n, "'; already registered (",
                            find_locked(n) ? find_locked(n)->info.name : std::string(), ")");
        }
        entries_.push_back(std::make_shared<const entry>(std::move(e)));
    }

    /// @brief Records the failure of a registration that must not throw: RPE_REGISTER_MAPPING runs
    /// during static initialisation (program start, dlopen of a plugin), where an exception would
    /// terminate the process. The message is kept until a loader takes it (take_load_errors, e.g.
    /// the `rpe` tool's --plugin right after dlopen) or the next rpe::families() throws it.
    void record_load_error(std::string message) noexcept {
        try {
            const std::lock_guard<std::mutex> lock(mutex_);
            load_errors_.push_back(std::move(message));
            has_load_errors_.store(true, std::memory_order_release);
        } catch (...) {  // out of memory at load: say so at least
            std::fputs("rpe: a mapping registration failed at load and could not be recorded\n", stderr);
        }
    }

    /// @brief The registration failures recorded since the last take, oldest first; clears them.
    /// Each is the refused registration's message (`[rpe.registry] name = '...'; already registered (...)`).
    [[nodiscard]] std::vector<std::string> take_load_errors() {
        const std::lock_guard<std::mutex> lock(mutex_);
        has_load_errors_.store(false, std::memory_order_relaxed);
        return std::exchange(load_errors_, {});
    }

    /// @brief Throws the recorded registration failures once (they are cleared): how a mapping
    /// refused at load that no loader checked (a unit linked into the program) fails at first use.
    /// rpe::families() calls it; cheap (one atomic load) when nothing is recorded.
    /// @throws rpe::invalid_argument with the recorded message, several joined by "; also ".
    void throw_load_errors() {
        if (!has_load_errors_.load(std::memory_order_acquire)) return;
        const auto errors = take_load_errors();
        if (errors.empty()) return;  // another thread took them
        std::string text = errors.front();
        for (std::size_t i = 1; i < errors.size(); ++i) text += "; also " + errors[i];
        throw invalid_argument(text);
    }

    /// @brief The family named `name` (canonical or alias), or nullptr.
    [[nodiscard]] std::shared_ptr<const entry> find(std::string_view name) const {
        const std::lock_guard<std::mutex> lock(mutex_);
        for (const auto& e : entries_)
            if (matches(*e, name)) return e;
        return nullptr;
    }

    /// @brief Every family, in the order added (the built-ins first).
    [[nodiscard]] std::vector<std::shared_ptr<const entry>> entries() const {
        const std::lock_guard<std::mutex> lock(mutex_);
        return entries_;
    }

    /// @brief Every name of the families of `kind`: "name" or "name (alias, alias)", comma-separated,
    /// for messages.
    [[nodiscard]] std::string names_text(family_kind kind) const {
        std::string s;
        for (const auto& e : entries()) {
            if (e->info.kind != kind) continue;
            s += (s.empty() ? "" : ", ") + e->info.name;
            if (!e->info.aliases.empty()) {
                s += " (";
                for (std::size_t i = 0; i < e->info.aliases.size(); ++i) s += (i ? ", " : "") + e->info.aliases[i].name;
                s += ")";
            }
        }
        return s;
    }

    /// @brief The spec of `name` (canonical or alias) with its defaults and the alias's presets.
    /// @throws rpe::invalid_argument `[rpe.term_spec] family = '...'; expected one of ...`.
    [[nodiscard]] family_spec defaults(std::string_view name, family_kind kind = family_kind::mapping) const {
        const auto e = find(name);
        if (!e || e->info.kind != kind)
            throw invalid_argument(detail::message("term_spec", kind == family_kind::rope ? "form = '" : "family = '", name,
                                                   "'; expected one of ", names_text(kind)));
        family_spec s{e->info.name, {}};
        for (const auto& p : e->info.params) s.params.emplace_back(p.name, p.default_value);
        for (const auto& a : e->info.aliases)
            if (a.name == name)
                for (const auto& [n, v] : a.presets) s.set(n, v);
        return s;
    }

    /// @brief Sets parameter `name` of `s` from its text (a number, an integer, true/false, a choice).
    /// @throws rpe::invalid_argument `[rpe.term_spec] <name> = '<text>'; expected ...`.
    void set_param(family_spec& s, std::string_view name, std::string_view text) const {
        const auto& p = param_of(s, name);
        const std::string t(text);
        double v = 0;
        switch (p.type) {
            case family_param::kind::choice: {
                const auto it = std::find(p.choices.begin(), p.choices.end(), t);
                if (it == p.choices.end()) {
                    std::string list;
                    for (std::size_t i = 0; i < p.choices.size(); ++i) list += (i ? ", " : "") + p.choices[i];
                    throw invalid_argument(detail::message("term_spec", name, " = '", text, "'; expected one of ", list));
                }
                v = static_cast<double>(it - p.choices.begin());
                break;
            }
            case family_param::kind::flag:
                if (t == "1" || t == "true")
                    v = 1;
                else if (t == "0" || t == "false")
                    v = 0;
                else
                    throw invalid_argument(
                        detail::message("term_spec", name, " = '", text, "'; expected one of true, false, 1, 0"));
                break;
            default: {
                const auto r = std::from_chars(t.data(), t.data() + t.size(), v);
                detail::require(r.ec == std::errc{} && r.ptr == t.data() + t.size(), "term_spec", name, " = '", text,
                                "'; expected a number");
            }
        }
        set_value(s, name, v);
    }

    /// @brief Sets parameter `name` of `s` to `v`, checked against its kind.
    /// @throws rpe::invalid_argument `[rpe.term_spec] <name> = <v>; expected ...`.
    void set_value(family_spec& s, std::string_view name, double v) const {
        const auto& p = param_of(s, name);
        detail::require(std::isfinite(v), "term_spec", name, " = ", v, "; expected a finite number");
        if (p.type == family_param::kind::integer)
            detail::require(v == std::floor(v) && std::fabs(v) <= (1 << 30), "term_spec", name, " = ", v,
                            "; expected an integer in [-2^30, 2^30]");
        if (p.type == family_param::kind::flag)
            detail::require(v == 0 || v == 1, "term_spec", name, " = ", v, "; expected 0 or 1");
        if (p.type == family_param::kind::choice)
            detail::require(v >= 0 && v < static_cast<double>(p.choices.size()) && v == std::floor(v), "term_spec", name, " = ",
                            v, "; expected a choice position in [0, ", p.choices.size(), ")");
        s.set(name, v);
    }

    /// @brief The text of value `v` of parameter `name` (a choice's name, true/false, a number).
    [[nodiscard]] std::string value_text(const family_spec& s, std::string_view name, double v) const {
        const auto& p = param_of(s, name);
        if (p.type == family_param::kind::choice) return p.choices.at(static_cast<std::size_t>(v));
        if (p.type == family_param::kind::flag) return v != 0 ? "true" : "false";
        return detail::number_text(v);
    }

    /// @brief Parses `family[:param=value,...]` (a family of `kind`).
    /// @throws rpe::invalid_argument `[rpe.term_spec] ...` naming the family, parameter or value.
    [[nodiscard]] family_spec parse(std::string_view text, family_kind kind = family_kind::mapping) const {
        const auto colon = text.find(':');
        family_spec s = defaults(text.substr(0, colon), kind);
        if (colon == std::string_view::npos) return s;
        std::string_view rest = text.substr(colon + 1);
        while (!rest.empty()) {
            const auto comma = rest.find(',');
            const std::string_view item = rest.substr(0, comma);
            const auto eq = item.find('=');
            detail::require(eq != std::string_view::npos, "term_spec", "parameter = '", item, "' of ", s.family,
                            "; expected name=value");
            set_param(s, item.substr(0, eq), item.substr(eq + 1));
            if (comma == std::string_view::npos) break;
            rest = rest.substr(comma + 1);
        }
        return s;
    }

    /// @brief `family:param=value,...` with every parameter (rpe::to_string).
    [[nodiscard]] std::string print(const family_spec& s) const {
        std::string t = s.family;
        for (std::size_t i = 0; i < s.params.size(); ++i)
            t += (i ? "," : ":") + s.params[i].first + "=" + value_text(s, s.params[i].first, s.params[i].second);
        return t;
    }

private:
    registry() = default;
    static bool matches(const entry& e, std::string_view name) {
        if (e.info.name == name) return true;
        return std::any_of(e.info.aliases.begin(), e.info.aliases.end(), [&](const auto& a) { return a.name == name; });
    }
    [[nodiscard]] const entry* find_locked(std::string_view name) const {
        for (const auto& e : entries_)
            if (matches(*e, name)) return e.get();
        return nullptr;
    }
    const family_param& param_of(const family_spec& s, std::string_view name) const {
        const auto e = find(s.family);
        detail::require(e != nullptr, "term_spec", "family = '", s.family, "'; not registered");
        for (const auto& p : e->info.params)
            if (p.name == name) return p;
        throw invalid_argument(
            detail::message("term_spec", "parameter = '", name, "' of ", s.family, "; expected one of ", s.names()));
    }

    mutable std::mutex mutex_;
    std::once_flag builtins_once_;
    std::vector<std::shared_ptr<const entry>> entries_;
    std::vector<std::string> load_errors_;      // registrations refused at load, not yet reported
    std::atomic<bool> has_load_errors_{false};  // !load_errors_.empty(), read without the lock
};

}  // namespace rpe
