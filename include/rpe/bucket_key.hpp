/// @file bucket_key.hpp
/// @brief What determines a set of bucket ids: rpe::bucket_key (the mapping, type-erased, the
/// grid, the skip tokens, the storage), its hash, and rpe::id_storage.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <type_traits>
#include <typeindex>

#include "concepts.hpp"

namespace rpe {

namespace detail {

/// @brief Type-erased mapping value, so one cache (and one id object) can hold any mapping.
struct mapping_key_base {
    virtual ~mapping_key_base() = default;
    [[nodiscard]] virtual bool equals(const mapping_key_base& other) const = 0;
    [[nodiscard]] virtual std::type_index type() const = 0;
};

template <GridMapping M>
struct mapping_key_of final : mapping_key_base {
    M mapping;
    explicit mapping_key_of(const M& m) : mapping(m) {}
    [[nodiscard]] bool equals(const mapping_key_base& other) const override {
        const auto* o = dynamic_cast<const mapping_key_of<M>*>(&other);
        return o != nullptr && o->mapping == mapping;
    }
    [[nodiscard]] std::type_index type() const override { return typeid(M); }
};

/// @brief The key of mapping type M without its cv-qualifiers, so that a term of
/// `decltype(m)` for `const auto m = ...` (M = const X) reads ids built from an X and the other way round.
template <class M>
using mapping_key = mapping_key_of<std::remove_cv_t<M>>;

}  // namespace detail

/// @brief How a bucket_ids object holds its ids.
enum class id_storage {
    automatic,   ///< `table` while the (L, L) matrices fit bucket_ids::auto_table_bytes, else `on_the_fly`
    table,       ///< (L, L) id matrices; refused beyond bucket_ids::max_bytes
    on_the_fly,  ///< only the per-offset ids, O(T·H·W) memory; each row of ids is made when read
};

/// @brief The whole configuration that determines bucket ids: the mapping (its type, index
/// function and α, β, γ), the grid depth, height and width, the number of skip tokens, and the
/// storage (never `automatic` in a built object's key).
struct bucket_key {
    std::shared_ptr<const detail::mapping_key_base> mapping;  ///< the mapping value, type-erased
    int height = 0;                                           ///< grid rows
    int width = 0;                                            ///< grid columns
    int skip = 0;                                             ///< extra tokens before the grid
    int depth = 1;                                            ///< grid frames (3D mappings; 1 for images)
    id_storage storage = id_storage::table;                   ///< how the ids are held

    /// @brief True when the mapping (type and value), depth, height, width, skip and storage all match.
    [[nodiscard]] bool operator==(const bucket_key& o) const {
        return height == o.height && width == o.width && skip == o.skip && depth == o.depth && storage == o.storage && mapping &&
               o.mapping && mapping->equals(*o.mapping);
    }

    /// @brief True when this key was made from mapping `m` (same type and value).
    template <GridMapping M>
    [[nodiscard]] bool holds(const M& m) const {
        return mapping && mapping->equals(detail::mapping_key<M>(m));
    }
};

/// @brief Hash of a bucket_key (mapping type, sizes, storage; equal mapping values of one type
/// share a hash and are told apart by `==`).
struct bucket_key_hash {
    std::size_t operator()(const bucket_key& k) const noexcept {
        std::size_t h = k.mapping ? k.mapping->type().hash_code() : 0;
        for (int v : {k.height, k.width, k.skip, k.depth, static_cast<int>(k.storage)}) h = h * 1000003u ^ std::hash<int>{}(v);
        return h;
    }
};

}  // namespace rpe
