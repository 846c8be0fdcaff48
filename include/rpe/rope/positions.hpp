/// @file rope/positions.hpp
/// @brief Per-token rotary positions of the common token layouts (rpe::rotary_embedding::positions):
/// a frames × height × width video grid (V-JEPA 2, M-RoPE's (t, h, w)) and a 2D grid repeated
/// (SAM2's memory keys).
#pragma once

#include <cstdint>
#include <vector>

#include "../detail/raise.hpp"

namespace rpe::rope {

/// @brief The (frame, row, col) ids of the tokens of a frames × height × width grid in row-major
/// order (frame slowest, column fastest), as V-JEPA 2's get_position_ids numbers a clip: token i
/// at (i div HW, (i mod HW) div W, i mod W). Returns (N, 3) float32, N = frames·height·width,
/// for rotary_embedding::positions of a 3-axis form (rope::vjepa2, rope::mrope).
/// @throws rpe::invalid_argument `[rpe.rope] grid frames, height, width = ...; expected >= 1`.
inline std::vector<float> grid_positions(int frames, int height, int width) {
    detail::require(frames >= 1 && height >= 1 && width >= 1, "rope", "grid frames, height, width = ", frames, ", ", height, ", ",
                    width, "; expected >= 1");
    detail::require(static_cast<std::int64_t>(frames) * height * width <= (std::int64_t{1} << 24), "rope",
                    "grid frames, height, width = ", frames, ", ", height, ", ", width,
                    "; expected at most 2^24 tokens (positions are exact float32 integers)");
    std::vector<float> p;
    p.reserve(static_cast<std::size_t>(3 * frames * height * width));
    for (int t = 0; t < frames; ++t)
        for (int r = 0; r < height; ++r)
            for (int c = 0; c < width; ++c)
                p.insert(p.end(), {static_cast<float>(t), static_cast<float>(r), static_cast<float>(c)});
    return p;
}

/// @brief The (row, col) positions of a height × width grid repeated `repeat` times: (R·H·W, 2)
/// float32, copy k of the grid at tokens k·H·W .. (k+1)·H·W − 1. SAM2's memory attention rotates
/// its keys so (RoPEAttention with rope_k_repeat: the query grid once per memory frame), with the
/// object-pointer tokens after them unrotated (rotary_embedding::suffix = num_k_exclude_rope).
/// @throws rpe::invalid_argument `[rpe.rope] grid height, width = ...` or `repeat = ...; expected >= 1`.
inline std::vector<float> repeated_grid_positions(int height, int width, int repeat) {
    detail::require(height >= 1 && width >= 1, "rope", "grid height, width = ", height, ", ", width, "; expected >= 1");
    detail::require(repeat >= 1, "rope", "repeat = ", repeat, "; expected >= 1 (copies of the grid)");
    detail::require(static_cast<std::int64_t>(repeat) * height * width <= (std::int64_t{1} << 24), "rope", "repeat = ", repeat,
                    " of a ", height, "x", width, " grid; expected at most 2^24 tokens");
    std::vector<float> p;
    p.reserve(static_cast<std::size_t>(2 * repeat * height * width));
    for (int k = 0; k < repeat; ++k)
        for (int r = 0; r < height; ++r)
            for (int c = 0; c < width; ++c) p.insert(p.end(), {static_cast<float>(r), static_cast<float>(c)});
    return p;
}

}  // namespace rpe::rope
