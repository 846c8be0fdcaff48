// libFuzzer harness: the .safetensors reader (rpe::io::safetensors_file::parse) on raw bytes,
// then every accessor of what it accepted. Properties: only our exception types escape (a bad
// header must not cause std::bad_alloc or a read outside the buffer: ASan checks that); every
// accepted tensor lies inside the data buffer and holds prod(shape) * itemsize bytes; tensors
// do not overlap; view() and to_vector() of the tensor's own dtype agree.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "rpe/io/safetensors.hpp"

namespace {

template <class T>
void read_as(const rpe::io::safetensors_file& f, const std::string& name) {
    const auto& ti = f.info(name);
    if (ti.dtype != rpe::io::detail::safetensors_dtype_of<T>()) {
        bool threw = false;
        try {
            (void)f.to_vector<T>(name);
        } catch (const rpe::invalid_argument&) {
            threw = true;
        }
        if (!threw) rpe_fuzz::fail("to_vector of tensor '" + name + "' with another dtype did not throw");
        return;
    }
    const std::vector<T> v = f.to_vector<T>(name);
    if (v.size() * sizeof(T) != static_cast<std::size_t>(ti.end - ti.begin))
        rpe_fuzz::fail("to_vector of tensor '" + name + "' has the wrong size");
    rpe_fuzz::ours_only([&] {
        const auto r = f.view<T>(name);
        if (static_cast<std::size_t>(r.size()) != v.size() ||
            (!v.empty() && std::memcmp(r.data, v.data(), v.size() * sizeof(T)) != 0))
            rpe_fuzz::fail("view and to_vector of tensor '" + name + "' differ");
    });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    std::vector<std::byte> bytes(size);
    if (size != 0) std::memcpy(bytes.data(), data, size);
    rpe::io::safetensors_file f;
    try {
        f = rpe::io::safetensors_file::parse(std::move(bytes), "fuzz.safetensors");
    } catch (const rpe::runtime_error&) {
        return 0;  // the documented error for a malformed file
    }
    std::int64_t covered = 0;
    for (const std::string& name : f.names()) {
        const auto& ti = f.info(name);
        const std::size_t item = rpe::io::detail::safetensors_dtype_size(ti.dtype);
        std::uint64_t count = 1;
        for (std::int64_t e : ti.shape) {
            if (e < 0) rpe_fuzz::fail("tensor '" + name + "' has a negative extent");
            count *= static_cast<std::uint64_t>(e);
        }
        if (item == 0 || ti.begin < 0 || ti.begin > ti.end || static_cast<std::uint64_t>(ti.end) > f.data_size() ||
            static_cast<std::uint64_t>(ti.end - ti.begin) != count * item)
            rpe_fuzz::fail("tensor '" + name + "' has an inconsistent directory entry");
        if (ti.end > ti.begin) {
            if (ti.begin < covered) rpe_fuzz::fail("tensor '" + name + "' overlaps the previous one");
            covered = ti.end;
        }
        read_as<float>(f, name);
        read_as<double>(f, name);
        read_as<std::int64_t>(f, name);
        read_as<std::int32_t>(f, name);
        read_as<std::uint8_t>(f, name);
        read_as<std::int16_t>(f, name);
    }
    for (const auto& [key, value] : f.metadata())
        if (f.metadata_value(key) != value) rpe_fuzz::fail("metadata_value('" + key + "') differs");
    rpe_fuzz::ours_only([&] { (void)f.metadata_value("no such key"); });
    rpe_fuzz::ours_only([&] { (void)f.info("no such tensor"); });
    return 0;
}
