/// @file mode.hpp
/// @brief Mode tags (bias, contextual) and the target enum (query, key, value).
#pragma once

namespace rpe {

namespace mode {

/// @brief Bias mode (paper eq. 14): one learned scalar per bucket (and table head), added to the
/// logits unscaled. Keys and queries only: bias mode on values does not exist (reference
/// `iRPE.reset_parameters` raises; rpe rejects it at compile time and at run time).
/// Table layout: (Ht, K).
struct bias {};

/// @brief Contextual mode (paper eqs. 15–17): one learned vector per bucket, dotted with the
/// scaled query (key target), the scaled key (query target), or weighted by the attention
/// probabilities (value target). Table layout: (Ht, D, K) on q/k, (Ht, K, D) on v.
struct contextual {};

}  // namespace mode

/// @brief Which input the RPE term attaches to (reference `rpe_on` letters q, k, v).
///
/// - `key`:   logits[b,h,i,j] += term from x = q·s at query i and bucket id(i, j)  (eq. 15)
/// - `query`: logits[b,h,i,j] += term from x = k·s at key j and bucket id(j, i)  (eq. 16; the
///   transposed pair, as the reference's `rpe_q(k*s).transpose(2,3)`)
/// - `value`: out[b,h,i,:] += Σ_j a[b,h,i,j]·table[id(i,j), :]  (eq. 17)
enum class target { query, key, value };

/// @brief How an output buffer is written: replaced, or added to (to sum terms into logits).
enum class write { overwrite, accumulate };

/// @brief The letter of a target: 'q', 'k' or 'v'.
constexpr char target_letter(target t) { return t == target::query ? 'q' : (t == target::key ? 'k' : 'v'); }

}  // namespace rpe
