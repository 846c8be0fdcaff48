/// @file io/atomic_file.hpp
/// @brief Writing a file all or nothing: a temporary file in the target's folder, renamed over
/// the target only once every byte is written, flushed and synced.
///
/// A reader of the target sees either the old file (or none) or the whole new one, never a
/// prefix: a full disk, a file-size limit (RLIMIT_FSIZE with SIGXFSZ ignored: `write` fails with
/// EFBIG), a read-only or missing folder, or an exception between open() and commit() leaves the
/// old target untouched and removes the temporary file. Every file rpe writes (io::save_npy, the
/// `rpe` tool's .npy and PNG outputs) goes through this helper.
/// Signals: a program that calls io::remove_temporaries_on_signals() once (the `rpe` tool does)
/// has its unfinished temporary files removed on SIGINT, SIGTERM and SIGHUP before the signal
/// takes its course. Not covered: SIGKILL, a crash, or a signal in a program that did not call
/// it leaves the temporary file (`<target>.tmp-<pid>-<n>`, next to the target) behind; the target
/// itself is still intact.
/// Targets that are not plain files: a symbolic link is followed link by link (the file it names
/// is replaced or, for a dangling link, created; the link stays; a cycle is an error); a path
/// naming an open descriptor of the process (`/dev/stdout`, `/dev/stderr`, `/dev/fd/N`,
/// `/proc/self/fd/N`) is written through that descriptor, at its current offset, whatever it is
/// (a terminal, a pipe, a file the shell redirected it to); an existing device, FIFO or socket
/// (`/dev/null`, a named pipe) is written in place, as there is no file to replace. A replaced
/// file keeps its permission bits (and its owner and group where the process may set them).
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
#include <csignal>     // sigaction, raise
#include <sys/stat.h>  // fchmod, stat
#include <unistd.h>    // dup, fchown, fsync, getpid, unlink
#endif

#include "../error.hpp"

namespace rpe::io {

namespace detail {

/// @brief The temporary files of unfinished atomic_file writes, as fixed slots that a signal
/// handler may read (async-signal-safe: lock-free atomics and a path copied in advance; no
/// allocation, no lock). A slot is free (0), being filled (1) or holds a path (2).
class temporary_registry {
public:
    static constexpr int slots = 32;               ///< concurrent writes covered; more are written unprotected
    static constexpr std::size_t max_path = 4096;  ///< longer paths are written unprotected

    static temporary_registry& instance() {
        static temporary_registry r;
        return r;
    }

    /// @brief Records `path`; returns its slot, or -1 when every slot is taken or the path too long.
    int add(const std::string& path) noexcept {
        if (path.size() >= max_path) return -1;
        for (int i = 0; i < slots; ++i) {
            int expected = 0;
            if (!slot_[i].state.compare_exchange_strong(expected, 1, std::memory_order_acquire)) continue;
            std::memcpy(slot_[i].path, path.c_str(), path.size() + 1);
            slot_[i].state.store(2, std::memory_order_release);
            return i;
        }
        return -1;
    }

    /// @brief Forgets slot `i` (no-op for -1).
    void remove(int i) noexcept {
        if (i >= 0 && i < slots) slot_[i].state.store(0, std::memory_order_release);
    }

    /// @brief Unlinks every recorded path; async-signal-safe (unlink(2) and atomic loads only).
    void unlink_all() noexcept {
#if defined(__unix__) || defined(__APPLE__)
        for (auto& s : slot_)
            if (s.state.load(std::memory_order_acquire) == 2) ::unlink(s.path);
#endif
    }

private:
    struct slot {
        std::atomic<int> state{0};
        char path[max_path] = {};
    };
    static_assert(std::atomic<int>::is_always_lock_free, "rpe: the signal-safe registry needs lock-free atomics");
    slot slot_[slots];
};

#if defined(__unix__) || defined(__APPLE__)
/// @brief The dispositions remove_temporaries_on_signals() replaced, restored before re-raising.
struct saved_dispositions {
    static constexpr int signals[3] = {SIGINT, SIGTERM, SIGHUP};
    struct sigaction previous[3] = {};
    std::atomic<bool> installed{false};

    static saved_dispositions& instance() {
        static saved_dispositions d;
        return d;
    }
};

extern "C" inline void rpe_io_remove_temporaries_and_reraise(int sig) {
    temporary_registry::instance().unlink_all();
    auto& d = saved_dispositions::instance();
    for (int i = 0; i < 3; ++i)
        if (saved_dispositions::signals[i] == sig) ::sigaction(sig, &d.previous[i], nullptr);
    ::raise(sig);  // the previous disposition (by default: terminate with this signal)
}
#endif

}  // namespace detail

/// @brief Makes SIGINT, SIGTERM and SIGHUP remove the temporary files of unfinished
/// atomic_file writes (so a target is left as it was, with no `<target>.tmp-<pid>-<n>` beside
/// it), then restores the signal's previous disposition and raises it again: by default the
/// process still terminates by that signal (exit status 128 + N in a shell).
///
/// Call it once, early, from a program's main (the `rpe` tool does); a library never installs
/// handlers on its own. A signal that is ignored when it is called (e.g. SIGHUP under nohup)
/// stays ignored. Calling it again does nothing. The handler is async-signal-safe: it reads paths
/// recorded before each write began (at most 32 writes at once and paths under 4096 bytes are
/// covered; others are written as before) and calls only unlink(2), sigaction(2) and raise(3).
/// A no-op outside POSIX systems. Thread-safety: call it before starting threads that write.
/// @throws rpe::runtime_error `[rpe.io] cannot install a handler for signal N (...)`.
inline void remove_temporaries_on_signals() {
#if defined(__unix__) || defined(__APPLE__)
    auto& d = detail::saved_dispositions::instance();
    if (d.installed.exchange(true)) return;
    (void)detail::temporary_registry::instance();  // constructed before any handler may run
    for (int i = 0; i < 3; ++i) {
        const int sig = detail::saved_dispositions::signals[i];
        struct sigaction current {};
        if (::sigaction(sig, nullptr, &current) != 0)
            throw runtime_error(rpe::detail::message("io", "cannot read the handler of signal ", sig, " (",
                                                     std::generic_category().message(errno), ")"));
        if (current.sa_handler == SIG_IGN) continue;  // nohup and the like: stays ignored
        d.previous[i] = current;
        struct sigaction handler {};
        handler.sa_handler = &detail::rpe_io_remove_temporaries_and_reraise;
        sigemptyset(&handler.sa_mask);
        for (const int other : detail::saved_dispositions::signals) sigaddset(&handler.sa_mask, other);
        handler.sa_flags = 0;
        if (::sigaction(sig, &handler, nullptr) != 0)
            throw runtime_error(rpe::detail::message("io", "cannot install a handler for signal ", sig, " (",
                                                     std::generic_category().message(errno), ")"));
    }
#endif
}

/// @brief A file written under a temporary name next to `target` and renamed over it by
/// commit(); destroyed uncommitted (an exception, an early return), it removes the temporary
/// file and leaves the target as it was.
///
/// Usage: `atomic_file f(path, "npy"); f.write(bytes); f.commit();`.
/// The temporary file is created exclusively (never an existing file) in the target's folder, so
/// the final rename stays within one file system and is atomic; its name is shortened when the
/// target's is within 30 bytes of the 255-byte limit. A symbolic link is followed: the file it
/// points to is replaced (created when missing) and the link kept. A descriptor path, device,
/// FIFO or socket is written in place (no temporary file; nothing to remove on failure).
/// Errors are rpe::runtime_error `[rpe.<component>] <target>: <what> (<errno text>); <target> is
/// unchanged`, where what is `cannot follow its symbolic links`, `cannot create a temporary file
/// in its folder`, `write failed`, `flush failed`, `sync failed`, `close failed` or `cannot
/// rename the temporary file over it` (in place: `cannot open it for writing`, `write failed`,
/// `flush failed`, `close failed`, without "is unchanged").
/// Thread-safety: one object per thread; distinct objects (even for one target) are independent
/// and the last commit wins.
class atomic_file {
public:
    /// @brief Creates the temporary file `<target>.tmp-<pid>-<n>` in the target's folder.
    /// @param component the message prefix, e.g. `"npy"` → `[rpe.npy]`.
    /// @throws rpe::invalid_argument `[rpe.<component>] path = ''; expected a file name` for an
    ///   empty target.
    /// @throws rpe::runtime_error `[rpe.<component>] <target>: cannot create a temporary file in
    ///   its folder (No such file or directory); <target> is unchanged` (missing or read-only folder).
    atomic_file(std::string target, const char* component = "io") : target_(std::move(target)), component_(component) {
        if (target_.empty()) throw invalid_argument(rpe::detail::message(component_, "path = ''; expected a file name"));
        const resolved r = resolve(target_);
        if (r.loop) fail("cannot follow its symbolic links", ELOOP);
        if (r.descriptor >= 0) {  // /dev/stdout, /dev/fd/N, /proc/self/fd/N: the open descriptor, in place
            in_place_ = true;
            if (r.descriptor <= 2) std::fflush(nullptr);  // what the program printed before comes first
            open_descriptor(r.descriptor);
            return;
        }
        std::error_code ec;
        const auto st = std::filesystem::status(r.path, ec);
        if (!ec && std::filesystem::exists(st) && !std::filesystem::is_regular_file(st) && !std::filesystem::is_directory(st)) {
            in_place_ = true;
            file_ = std::fopen(r.path.c_str(), "wb");  // a device, FIFO or socket: written in place
            if (file_ == nullptr) fail("cannot open it for writing", errno);
            return;
        }
        static std::atomic<unsigned long> counter{0};
        const std::filesystem::path real(r.path);
        for (int attempt = 0; attempt < 100 && file_ == nullptr; ++attempt) {
            temp_ = temporary_name(real, process_id(), counter++);
            // recorded before it exists, so a signal at any moment finds it (remove_temporaries_on_signals)
            std::error_code abs_ec;
            const auto absolute = std::filesystem::absolute(temp_, abs_ec);
            slot_ = detail::temporary_registry::instance().add(abs_ec ? temp_ : absolute.string());
            file_ = std::fopen(temp_.c_str(), "wbx");  // C11 exclusive mode: fails if the name exists
            if (file_ == nullptr) {
                const int err = errno;
                detail::temporary_registry::instance().remove(std::exchange(slot_, -1));
                errno = err;
                if (err != EEXIST) break;
            }
        }
        if (file_ == nullptr) {
            const int err = errno;
            temp_.clear();
            fail("cannot create a temporary file in its folder", err);
        }
        keep_mode_and_owner(r.path);
        real_ = r.path;
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
        detail::temporary_registry::instance().remove(std::exchange(slot_, -1));  // renamed: nothing to remove
    }

    /// @brief Closes and removes the temporary file (the target stays as it was); never throws.
    void discard() noexcept {
        if (file_ != nullptr) std::fclose(std::exchange(file_, nullptr));
        if (!temp_.empty()) {
            std::error_code ec;
            std::filesystem::remove(temp_, ec);
            temp_.clear();
        }
        detail::temporary_registry::instance().remove(std::exchange(slot_, -1));
    }

private:
    std::string target_;
    const char* component_;
    std::string real_;  // target_, or the file a symbolic link target_ names
    std::string temp_;  // empty when written in place or once committed / discarded
    std::FILE* file_ = nullptr;
    bool in_place_ = false;  // a device, FIFO or socket
    int slot_ = -1;          // temp_'s slot in detail::temporary_registry, or -1

    struct resolved {
        std::string path;     // the file to replace (may not exist yet: a dangling link names it)
        int descriptor = -1;  // >= 0: the path names this open descriptor of the process
        bool loop = false;    // more than 40 links (a cycle)
    };

    // The descriptor a path names: /dev/stdin|stdout|stderr, /dev/fd/N, /proc/self/fd/N,
    // /proc/thread-self/fd/N or /proc/<this pid>/fd/N; -1 for any other path.
    static int descriptor_of(const std::filesystem::path& p) {
        std::error_code ec;
        const std::filesystem::path abs = std::filesystem::absolute(p, ec);  // `fd/1` from /dev too
        const std::string s = (ec ? p : abs).lexically_normal().generic_string();
        if (s == "/dev/stdin") return 0;
        if (s == "/dev/stdout") return 1;
        if (s == "/dev/stderr") return 2;
        const std::string pid = "/proc/" + std::to_string(process_id()) + "/fd/";
        for (const std::string_view prefix : {std::string_view("/dev/fd/"), std::string_view("/proc/self/fd/"),
                                              std::string_view("/proc/thread-self/fd/"), std::string_view(pid)}) {
            if (s.size() <= prefix.size() || s.compare(0, prefix.size(), prefix) != 0 || s.size() - prefix.size() > 9) continue;
            int fd = 0;
            for (std::size_t i = prefix.size(); i < s.size(); ++i) {
                if (s[i] < '0' || s[i] > '9') return -1;
                fd = fd * 10 + (s[i] - '0');
            }
            return fd;
        }
        return -1;
    }

    // Follows `target`'s chain of symbolic links one link at a time (relative links against their
    // folder), stopping at a path that names an open descriptor.
    static resolved resolve(const std::string& target) {
        std::filesystem::path p(target);
        for (int links = 0; links <= 40; ++links) {
            if (const int fd = descriptor_of(p); fd >= 0) return {p.string(), fd, false};
            std::error_code ec;
            if (!std::filesystem::is_symlink(std::filesystem::symlink_status(p, ec))) return {p.string(), -1, false};
            const std::filesystem::path next = std::filesystem::read_symlink(p, ec);
            if (ec) return {p.string(), -1, false};
            p = next.is_absolute() ? next : p.parent_path() / next;
        }
        return {target, -1, true};
    }

    // `<name>.tmp-<pid>-<n>` next to `real`, the name shortened so that it stays within the
    // usual 255-byte limit of a file name.
    static std::string temporary_name(const std::filesystem::path& real, long pid, unsigned long n) {
        const std::string suffix = ".tmp-" + std::to_string(pid) + "-" + std::to_string(n);
        std::string name = real.filename().string();
        if (name.size() + suffix.size() > 255) name.resize(255 - suffix.size());
        return (real.parent_path() / (name + suffix)).string();
    }

    void open_descriptor(int fd) {
#if defined(__unix__) || defined(__APPLE__)
        const int copy = ::dup(fd);
        if (copy < 0) fail("cannot open it for writing", errno);
        file_ = ::fdopen(copy, "wb");
        if (file_ == nullptr) {
            const int err = errno;
            ::close(copy);
            fail("cannot open it for writing", err);
        }
#else
        (void)fd;
        fail("cannot open it for writing", ENOTSUP);
#endif
    }

    // The replacement keeps the permission bits (and, where allowed, the owner) of the file it
    // replaces; a new file gets the default mode (0666 less the umask).
    void keep_mode_and_owner(const std::string& real) const {
#if defined(__unix__) || defined(__APPLE__)
        struct ::stat old {};
        if (::stat(real.c_str(), &old) != 0 || !S_ISREG(old.st_mode)) return;
        const int fd = ::fileno(file_);
        if (::fchown(fd, old.st_uid, old.st_gid) != 0) {
            // not allowed (another owner): keep ours; the mode below is still copied
        }
        if (::fchmod(fd, old.st_mode & 07777) != 0) {
            // a file system without modes: the default mode stays
        }
#else
        (void)real;
#endif
    }

    static long process_id() {
#if defined(__unix__) || defined(__APPLE__)
        return static_cast<long>(::getpid());
#else
        return 0;
#endif
    }

    void require_open() const {
        if (file_ == nullptr)
            throw runtime_error(
                rpe::detail::message(component_, target_, ": the temporary file is already committed or discarded"));
    }

    [[noreturn]] void fail(const char* what, int err) const {
        if (in_place_)  // a device or FIFO: what was written is gone, there is no old content to keep
            throw runtime_error(
                rpe::detail::message(component_, target_, ": ", what, " (", std::generic_category().message(err), ")"));
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
