// libFuzzer harness: the .npy reader (rpe::io::parse_npy) on raw bytes, then every conversion of
// what it accepted. Properties: only rpe::invalid_argument / out_of_range / runtime_error escape
// (std::bad_alloc or std::length_error would be a defect: a bad header must not allocate much);
// an accepted array holds exactly size() * itemsize() bytes; encode_npy of an accepted float32,
// float64, int64 or uint8 array parses back to the same dtype, shape and bytes.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "rpe/io/npy.hpp"

namespace {

template <class T>
void round_trip(const rpe::io::npy_array& a) {
    if (a.dtype != rpe::io::detail::npy_descr_of<T>()) return;
    const std::vector<T> values = a.as<T>();
    const std::vector<std::byte> bytes = rpe::io::encode_npy(values.data(), std::span<const std::int64_t>(a.shape));
    const rpe::io::npy_array b = rpe::io::parse_npy(bytes, "round-trip");
    if (b.dtype != a.dtype || b.shape != a.shape || b.bytes != a.bytes)
        rpe_fuzz::fail("encode_npy(parse_npy(x)) does not parse back to the same array (dtype " + a.dtype + ")");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
    rpe::io::npy_array a;
    try {
        a = rpe::io::parse_npy(bytes, "fuzz.npy");
    } catch (const rpe::runtime_error&) {
        return 0;  // the documented error for a malformed file
    }
    if (a.itemsize() == 0 || a.bytes.size() != a.size() * a.itemsize())
        rpe_fuzz::fail("accepted array of dtype " + a.dtype + " holds " + std::to_string(a.bytes.size()) + " bytes for " +
                       std::to_string(a.size()) + " elements");
    rpe_fuzz::ours_only([&] { (void)a.to<float>(); });
    rpe_fuzz::ours_only([&] { (void)a.to<double>(); });
    rpe_fuzz::ours_only([&] { (void)a.to<std::int64_t>(); });
    rpe_fuzz::ours_only([&] { (void)a.to<std::int32_t>(); });
    rpe_fuzz::ours_only([&] { (void)a.to<std::uint8_t>(); });
    rpe_fuzz::ours_only([&] { (void)a.to<std::uint64_t>(); });
    rpe_fuzz::ours_only([&] { (void)a.to<bool>(); });
    rpe_fuzz::ours_only([&] { (void)a.as<float>(); });
    rpe_fuzz::ours_only([&] { (void)a.as<bool>(); });
    rpe_fuzz::ours_only([&] { (void)a.as<std::int64_t>(); });
    round_trip<float>(a);
    round_trip<double>(a);
    round_trip<std::int64_t>(a);
    round_trip<std::uint8_t>(a);
    return 0;
}
