/// @file bucket_ids.hpp
/// @brief Bucket ids of every (query, key) token pair of a grid, one header per job: what
/// determines them (bucket_key.hpp), the ids and their offset math (bucket_id_set.hpp), the
/// builder (build_bucket_ids.hpp) and the shared single-flight cache (bucket_cache.hpp).
#pragma once

#include "bucket_cache.hpp"
#include "bucket_id_set.hpp"
#include "bucket_key.hpp"
#include "build_bucket_ids.hpp"
