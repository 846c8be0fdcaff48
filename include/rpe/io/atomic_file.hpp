/// @file io/atomic_file.hpp
/// @brief Writing a file all or nothing: a temporary file in the target's folder, renamed over
/// the target only once every byte is written, flushed and synced.
///
/// A reader of the target sees either the old file (or none) or the whole new one, never a
/// prefix: a full disk, a file-size limit (RLIMIT_FSIZE with SIGXFSZ ignored: `write` fails with
/// EFBIG), a read-only or missing folder, or an exception between open() and commit() leaves the
/// old target untouched and removes the temporary file. Every file rpe writes (io::save_npy, the
/// `rpe` tool's .npy and PNG outputs) goes through this helper.
/// Not covered: a crash or SIGKILL between open() and commit() leaves the temporary file
/// (`<target>.tmp-<pid>-<n>`, next to the target) behind; the target itself is still intact.
/// Targets that are not files: a symbolic link is followed (the file it names is replaced, the
/// link stays); an existing device, FIFO or socket (`/dev/null`, `/dev/stdout`, a pipe) is
/// written in place, as there is no file to replace (and replacing `/dev/null` would be wrong).
/// Source: POSIX rename(2) (atomic replacement within one file system).
#pragma once

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>  // fsync, getpid
#endif

#include "../error.hpp"

namespace rpe::io {

/// @brief A file written under a temporary name next to `target` and renamed over it by
/// commit(); destroyed uncommitted (an exception, an early return), it removes the temporary
/// file and leaves the target as it was.
///
/// Usage: `atomic_file f(path, "npy"); f.write(bytes); f.commit();`.
/// The temporary file is created exclusively (never an existing file) in the target's folder, so
/// the final rename stays within one file system and is atomic. A symbolic link is followed:
/// the file it points to is replaced and the link kept. An existing device, FIFO or socket is
/// opened and written in place (no temporary file; nothing to remove on failure).
/// Errors are rpe::runtime_error `[rpe.<component>] <target>: <what> (<errno text>); <target> is
/// unchanged`, where what is `cannot create a temporary file in its folder`, `write failed`,
/// `flush failed`, `sync failed`, `close failed` or `cannot rename the temporary file over it`.
/// Thread-safety: one object per thread; distinct objects (even for one target) are independent
/// and the last commit wins.
class atomic_file {
public:
    /// @brief Creates the temporary file `<target>.tmp-<pid>-<n>` in the target's folder.
    /// @param component the message prefix, e.g. `"npy"` → `[rpe.npy]`.
    /// @throws rpe::runtime_error `[rpe.<component>] <target>: cannot create a temporary file in
    ///   its folder (No such file or directory); <target> is unchanged` (missing or read-only folder).
    atomic_file(std::string target, const char* component = "io") : target_(std::move(target)), component_(component) {
        std::error_code ec;
        const auto st = std::filesystem::status(target_, ec);  // follows symbolic links
        if (!ec && std::filesystem::exists(st) && !std::filesystem::is_regular_file(st) && !std::filesystem::is_directory(st)) {
            file_ = std::fopen(target_.c_str(), "wb");  // a device, FIFO or socket: written in place
            if (file_ == nullptr) fail("cannot open it for writing", errno);
            in_place_ = true;
            return;
        }
        std::string real = target_;  // the file a symbolic link names is replaced, the link stays
        if (std::filesystem::is_symlink(std::filesystem::symlink_status(target_, ec))) {
            const auto resolved = std::filesystem::weakly_canonical(target_, ec);
            if (!ec) real = resolved.string();
        }
        static std::atomic<unsigned long> counter{0};
        for (int attempt = 0; attempt < 100 && file_ == nullptr; ++attempt) {
            temp_ = real + ".tmp-" + std::to_string(process_id()) + "-" + std::to_string(counter++);
            file_ = std::fopen(temp_.c_str(), "wbx");  // C11 exclusive mode: fails if the name exists
            if (file_ == nullptr && errno != EEXIST) break;
        }
        if (file_ == nullptr) fail("cannot create a temporary file in its folder", errno);
        real_ = std::move(real);
    }

    atomic_file(const atomic_file&) = delete;
    atomic_file& operator=(const atomic_file&) = delete;

    /// @brief Removes the temporary file unless commit() succeeded; never throws.
    ~atomic_file() { discard(); }

    /// @brief The file that commit() replaces.
    [[nodiscard]] const std::string& target() const { return target_; }
    /// @brief The temporary file's name (empty once committed or discarded).
    [[nodiscard]] const std::string& temporary() const { return temp_; }

    /// @brief Appends `bytes`. @throws rpe::runtime_error `... write failed (File too large) ...`;
    /// the temporary file is removed.
    void write(std::span<const std::byte> bytes) {
        require_open();
        if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), file_) != bytes.size()) {
            const int err = errno;
            discard();
            fail("write failed", err);
        }
    }
    /// @brief Appends the characters of `text`. @throws as write(span).
    void write(std::string_view text) { write(std::as_bytes(std::span<const char>(text.data(), text.size()))); }

    /// @brief Flushes, syncs to the device, closes and renames the temporary file over the target.
    /// @throws rpe::runtime_error `... flush failed / sync failed / close failed / cannot rename
    ///   the temporary file over it ...`; the temporary file is removed and the target unchanged.
    void commit() {
        require_open();
        if (std::fflush(file_) != 0 || std::ferror(file_)) {
            const int err = errno;
            discard();
            fail("flush failed", err);
        }
        if (in_place_) {
            const bool closed = std::fclose(std::exchange(file_, nullptr)) == 0;
            if (!closed) fail("close failed", errno);
            return;
        }
#if defined(__unix__) || defined(__APPLE__)
        if (::fsync(::fileno(file_)) != 0 && errno != EINVAL && errno != EROFS) {  // EINVAL: a pipe or special file
            const int err = errno;
            discard();
            fail("sync failed", err);
        }
#endif
        std::FILE* f = std::exchange(file_, nullptr);
        if (std::fclose(f) != 0) {
            const int err = errno;
            discard();
            fail("close failed", err);
        }
        std::error_code ec;
        std::filesystem::rename(temp_, real_, ec);
        if (ec) {
            discard();
            fail("cannot rename the temporary file over it", ec.value());
        }
        temp_.clear();
    }

    /// @brief Closes and removes the temporary file (the target stays as it was); never throws.
    void discard() noexcept {
        if (file_ != nullptr) std::fclose(std::exchange(file_, nullptr));
        if (!temp_.empty()) {
            std::error_code ec;
            std::filesystem::remove(temp_, ec);
            temp_.clear();
        }
    }

private:
    std::string target_;
    const char* component_;
    std::string real_;       // target_, or the file a symbolic link target_ names
    std::string temp_;       // empty when written in place or once committed / discarded
    std::FILE* file_ = nullptr;
    bool in_place_ = false;  // a device, FIFO or socket

    static long process_id() {
#if defined(__unix__) || defined(__APPLE__)
        return static_cast<long>(::getpid());
#else
        return 0;
#endif
    }

    void require_open() const {
        if (file_ == nullptr)
            throw runtime_error(rpe::detail::message(component_, target_, ": the temporary file is already committed or discarded"));
    }

    [[noreturn]] void fail(const char* what, int err) const {
        if (in_place_)  // a device or FIFO: what was written is gone, there is no old content to keep
            throw runtime_error(rpe::detail::message(component_, target_, ": ", what, " (", std::generic_category().message(err), ")"));
        throw runtime_error(rpe::detail::message(component_, target_, ": ", what, " (", std::generic_category().message(err),
                                                 "); ", target_, " is unchanged"));
    }
};

/// @brief Writes `bytes` to `path` all or nothing (see atomic_file): a temporary file in the same
/// folder, written, flushed and synced, then renamed over `path`.
/// @param component the message prefix, e.g. `"npy"` → `[rpe.npy]`.
/// @throws rpe::runtime_error `[rpe.<component>] <path>: cannot create a temporary file in its
///   folder (...)`, `write failed (...)`, ... `; <path> is unchanged`: on every failure the
///   temporary file is removed and an existing `path` keeps its old content.
inline void write_file_atomically(const std::string& path, std::span<const std::byte> bytes, const char* component = "io") {
    atomic_file f(path, component);
    f.write(bytes);
    f.commit();
}

/// @brief write_file_atomically() for text (or any characters).
inline void write_file_atomically(const std::string& path, std::string_view text, const char* component = "io") {
    write_file_atomically(path, std::as_bytes(std::span<const char>(text.data(), text.size())), component);
}

}  // namespace rpe::io
