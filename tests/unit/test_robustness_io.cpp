// Issue 16: nothing half-written, nothing sized from unchecked input.
// - every write goes through io::atomic_file: a failed write (file-size limit, missing or
//   read-only folder, a directory in the way) leaves no partial file and an old target unchanged;
// - the readers check every extent and the product of the non-zero extents before sizing anything;
// - enum parameters outside their enumerators, and α/γ that break the index's float math, are refused.
#include <doctest/doctest.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <rpe/attention.hpp>
#include <rpe/io/atomic_file.hpp>
#include <rpe/io/npy.hpp>
#include <rpe/io/safetensors.hpp>
#include <rpe/make_term.hpp>
#include <rpe/rpe.hpp>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_robustness_io {

namespace {

namespace fs = std::filesystem;

using rpe_test::error_of;  // tests/unit/golden.hpp

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// A fresh empty folder under the temp folder (random suffix: ctest runs cases in parallel).
struct scratch_dir {
    fs::path path;
    scratch_dir() {
        std::random_device rd;
        path = fs::temp_directory_path() / ("rpe_atomic_" + std::to_string(rd()) + "_" + std::to_string(rd()));
        fs::create_directories(path);
    }
    ~scratch_dir() {
        std::error_code ec;
        fs::permissions(path, fs::perms::owner_all, fs::perm_options::add, ec);
        fs::remove_all(path, ec);
    }
    [[nodiscard]] std::string file(const std::string& name) const { return (path / name).string(); }
    /// The names in the folder (a partial or temporary file would show here).
    [[nodiscard]] std::set<std::string> names() const {
        std::set<std::string> out;
        for (const auto& e : fs::directory_iterator(path)) out.insert(e.path().filename().string());
        return out;
    }
};

std::string read_text(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_text(const std::string& path, const std::string& text) {
    std::ofstream out(path, std::ios::binary);
    out << text;
}

/// In a forked child: puts back the default action of the signals doctest's crash handler catches
/// (SIGINT, SIGILL, SIGFPE, SIGSEGV, SIGTERM, SIGABRT) and of SIGHUP (ignored under nohup). The
/// child inherits the parent's handlers: doctest's would print a "test case CRASHED" summary of a
/// test that passes when the child ends by the signal it is meant to end by.
void default_signal_actions_in_child() {
    for (const int sig : {SIGINT, SIGILL, SIGFPE, SIGSEGV, SIGTERM, SIGABRT, SIGHUP}) std::signal(sig, SIG_DFL);
}

/// Runs `f` in a forked child (so that the limits it sets stay there) and returns what the
/// child's `f` returned, or "child exited with status ..." when it did not finish normally.
std::string in_child(const std::function<std::string()>& f) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        default_signal_actions_in_child();
        ::close(fds[0]);
        std::string out;
        try {
            out = f();
        } catch (const std::exception& e) {
            out = std::string("unexpected exception: ") + e.what();
        }
        const ssize_t written = ::write(fds[1], out.data(), out.size());
        ::_exit(written == static_cast<ssize_t>(out.size()) ? 0 : 1);
    }
    ::close(fds[1]);
    std::string got;
    char buf[512];
    for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) got.append(buf, static_cast<std::size_t>(n));
    ::close(fds[0]);
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return "child exited with status " + std::to_string(status) + ": " + got;
    return got;
}

/// In a child: ignore SIGXFSZ, limit files to `bytes`, run `f` and return its exception message.
std::string error_under_file_limit(rlim_t bytes, const std::function<void()>& f) {
    return in_child([&]() -> std::string {
        std::signal(SIGXFSZ, SIG_IGN);
        rlimit lim{};
        ::getrlimit(RLIMIT_FSIZE, &lim);
        lim.rlim_cur = bytes;
        if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) return "setrlimit failed";
        try {
            f();
        } catch (const rpe::runtime_error& e) {
            return e.what();
        }
        return "did not throw";
    });
}

/// The (14x14 grid, class token) ids of the reproducer as an (L, L) uint8 array: 39 KB.
std::vector<std::uint8_t> big_ids() { return std::vector<std::uint8_t>(197 * 197, 7); }
const std::vector<std::int64_t> big_shape{197, 197};

}  // namespace

TEST_CASE("atomic writes: a file-size limit leaves no partial .npy and the old file unchanged") {
    const scratch_dir dir;
    const auto ids = big_ids();
    SUBCASE("new target") {
        const std::string path = dir.file("f.npy");
        const std::string e = error_under_file_limit(8192, [&] { rpe::io::save_npy(path, ids.data(), big_shape); });
        CHECK(e == "[rpe.npy] " + path + ": write failed (File too large); " + path + " is unchanged");
        CHECK(dir.names().empty());  // neither f.npy (8192 of 38873 bytes before) nor the temporary file
    }
    SUBCASE("existing target") {
        const std::string path = dir.file("f.npy");
        write_text(path, "old content");
        const std::string e = error_under_file_limit(8192, [&] { rpe::io::save_npy(path, ids.data(), big_shape); });
        CHECK(contains(e, "write failed (File too large)"));
        CHECK(read_text(path) == "old content");
        CHECK(dir.names() == std::set<std::string>{"f.npy"});
    }
    SUBCASE("the same write without the limit succeeds and replaces the old file") {
        const std::string path = dir.file("f.npy");
        write_text(path, "old content");
        CHECK(in_child([&] {
                  rpe::io::save_npy(path, ids.data(), big_shape);
                  return std::string("ok");
              }) == "ok");
        const auto back = rpe::io::load_npy(path);
        CHECK(back.shape == big_shape);
        CHECK(back.as<std::uint8_t>() == ids);
        CHECK(dir.names() == std::set<std::string>{"f.npy"});
    }
}

TEST_CASE("atomic writes: a missing folder, a read-only folder or a directory in the way leave nothing behind") {
    const scratch_dir dir;
    const float x = 1.0f;
    const std::vector<std::int64_t> s{1};
    SUBCASE("missing folder") {
        const std::string path = dir.file("no_such_dir/out.npy");
        CHECK(error_of<rpe::runtime_error>([&] { rpe::io::save_npy(path, &x, s); }) ==
              "[rpe.npy] " + path + ": cannot create a temporary file in its folder (No such file or directory); " + path +
                  " is unchanged");
        CHECK(dir.names().empty());
    }
    SUBCASE("read-only folder (in a child that is not root: root writes anywhere)") {
        const std::string path = dir.file("out.npy");
        write_text(path, "old");
        fs::permissions(dir.path, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read | fs::perms::group_exec |
                                      fs::perms::others_read | fs::perms::others_exec);
        const std::string e = in_child([&]() -> std::string {
            if (::geteuid() == 0 && ::setuid(65534) != 0) return "setuid failed";  // nobody
            try {
                rpe::io::save_npy(path, &x, s);
            } catch (const rpe::runtime_error& err) {
                return err.what();
            }
            return "did not throw";
        });
        CHECK(e == "[rpe.npy] " + path + ": cannot create a temporary file in its folder (Permission denied); " + path +
                       " is unchanged");
        CHECK(read_text(path) == "old");
        CHECK(dir.names() == std::set<std::string>{"out.npy"});
    }
    SUBCASE("a directory where the file should go: the rename fails, the temporary file is removed") {
        const std::string path = dir.file("taken");
        fs::create_directory(path);
        write_text((fs::path(path) / "inside").string(), "keep");
        const std::string e = error_of<rpe::runtime_error>([&] { rpe::io::save_npy(path, &x, s); });
        CHECK(contains(e, "[rpe.npy] " + path + ": cannot rename the temporary file over it ("));
        CHECK(contains(e, "; " + path + " is unchanged"));
        CHECK(dir.names() == std::set<std::string>{"taken"});
        CHECK(read_text((fs::path(path) / "inside").string()) == "keep");
    }
}

TEST_CASE("atomic writes: links are followed, descriptors and devices are written in place (never replaced)") {
    const scratch_dir dir;
    const float x[2] = {1.0f, 2.0f};
    const std::vector<std::int64_t> s{2};
    SUBCASE("a link to a file: the file is replaced, the link stays a link") {
        write_text(dir.file("real.npy"), "old");
        fs::create_symlink("real.npy", dir.path / "link.npy");
        rpe::io::save_npy(dir.file("link.npy"), x, s);
        CHECK(fs::is_symlink(dir.path / "link.npy"));
        CHECK(rpe::io::load_npy(dir.file("real.npy")).as<float>() == std::vector<float>{1.0f, 2.0f});
        CHECK(dir.names() == std::set<std::string>{"link.npy", "real.npy"});
    }
    SUBCASE("a dangling link: the file it names is created, the link stays") {
        fs::create_symlink("made.npy", dir.path / "dangling.npy");
        rpe::io::save_npy(dir.file("dangling.npy"), x, s);
        CHECK(fs::is_symlink(dir.path / "dangling.npy"));
        CHECK(rpe::io::load_npy(dir.file("made.npy")).as<float>() == std::vector<float>{1.0f, 2.0f});
        CHECK(dir.names() == std::set<std::string>{"dangling.npy", "made.npy"});
    }
    SUBCASE("a chain of relative links through another folder") {
        fs::create_directory(dir.path / "sub");
        write_text(dir.file("sub/real.npy"), "old");
        fs::create_symlink("real.npy", dir.path / "sub" / "inner.npy");
        fs::create_symlink("sub/inner.npy", dir.path / "outer.npy");
        rpe::io::save_npy(dir.file("outer.npy"), x, s);
        CHECK(fs::is_symlink(dir.path / "outer.npy"));
        CHECK(fs::is_symlink(dir.path / "sub" / "inner.npy"));
        CHECK(rpe::io::load_npy(dir.file("sub/real.npy")).as<float>() == std::vector<float>{1.0f, 2.0f});
    }
    SUBCASE("a cycle of links: an error, nothing created, the links stay") {
        fs::create_symlink("b.npy", dir.path / "a.npy");
        fs::create_symlink("a.npy", dir.path / "b.npy");
        const std::string path = dir.file("a.npy");
        CHECK(error_of<rpe::runtime_error>([&] { rpe::io::save_npy(path, x, s); }) ==
              "[rpe.npy] " + path + ": cannot follow its symbolic links (Too many levels of symbolic links); " + path +
                  " is unchanged");
        CHECK(fs::is_symlink(dir.path / "a.npy"));
        CHECK(fs::is_symlink(dir.path / "b.npy"));
        CHECK(dir.names() == std::set<std::string>{"a.npy", "b.npy"});
    }
    SUBCASE("/dev/fd/N and /proc/self/fd/N of a redirected file: written through the descriptor, after what it holds") {
        for (const std::string prefix : {"/dev/fd/", "/proc/self/fd/"}) {
            if (!fs::exists(prefix)) continue;
            CAPTURE(prefix);
            const std::string path = dir.file("redirected.bin");
            std::FILE* f = std::fopen(path.c_str(), "wb");
            REQUIRE(f != nullptr);
            std::fputs("head:", f);
            std::fflush(f);
            struct ::stat before {};
            REQUIRE(::stat(path.c_str(), &before) == 0);
            rpe::io::save_npy(prefix + std::to_string(::fileno(f)), x, s);
            std::fputs(":tail", f);
            std::fclose(f);
            const std::string all = read_text(path);
            CHECK(all.substr(0, 5) == "head:");
            CHECK(all.substr(5, 6) == "\x93NUMPY");
            CHECK(all.substr(all.size() - 5) == ":tail");
            struct ::stat after {};
            REQUIRE(::stat(path.c_str(), &after) == 0);
            CHECK(after.st_ino == before.st_ino);                           // the same file, not a replacement
            CHECK(dir.names() == std::set<std::string>{"redirected.bin"});  // no temporary file, not replaced
            fs::remove(path);
        }
    }
    SUBCASE("an empty path: a clear error, nothing written") {
        CHECK(error_of<rpe::invalid_argument>([&] { rpe::io::save_npy("", x, s); }) ==
              "[rpe.npy] path = ''; expected a file name");
    }
    SUBCASE("a closed descriptor: a clear error") {
        CHECK(error_of<rpe::runtime_error>([&] { rpe::io::save_npy("/dev/fd/987654", x, s); }) ==
              "[rpe.npy] /dev/fd/987654: cannot open it for writing (Bad file descriptor)");
    }
    SUBCASE("a replaced file keeps its permission bits") {
        const std::string path = dir.file("mode.npy");
        write_text(path, "old");
        fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
        rpe::io::save_npy(path, x, s);
        CHECK(fs::status(path).permissions() == (fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read));
        CHECK(rpe::io::load_npy(path).as<float>() == std::vector<float>{1.0f, 2.0f});
    }
    SUBCASE("a 255-byte file name: the temporary name is shortened to fit") {
        const std::string path = dir.file(std::string(251, 'n') + ".npy");
        write_text(path, "old");
        rpe::io::save_npy(path, x, s);
        CHECK(rpe::io::load_npy(path).as<float>() == std::vector<float>{1.0f, 2.0f});
        CHECK(dir.names().size() == 1);
    }
    SUBCASE("/dev/null stays the null device") {
        rpe::io::save_npy("/dev/null", x, s);
        CHECK(fs::is_character_file("/dev/null"));
        CHECK(!fs::exists("/dev/null.tmp-" + std::to_string(::getpid()) + "-0"));
    }
    SUBCASE("/dev/full: the error of the device, and the device stays") {
        if (fs::is_character_file("/dev/full")) {
            CHECK(error_of<rpe::runtime_error>([&] { rpe::io::save_npy("/dev/full", x, s); }) ==
                  "[rpe.npy] /dev/full: flush failed (No space left on device)");
            CHECK(fs::is_character_file("/dev/full"));
        }
    }
}

TEST_CASE("npy: load_npy reads no further than the data its header announces (+1 byte)") {
    const scratch_dir dir;
    const std::string path = dir.file("sparse.npy");
    const float x[3] = {1.0f, 2.0f, 3.0f};
    const std::vector<std::int64_t> s{3};
    rpe::io::save_npy(path, x, s);
    const auto size = fs::file_size(path);
    SUBCASE("20 GB of trailing zeros (a sparse file): refused after reading one byte past the data") {
        fs::resize_file(path, std::uintmax_t{20} << 30);
        CHECK(error_of<rpe::runtime_error>([&] { (void)rpe::io::load_npy(path); }) ==
              "[rpe.npy] " + path + ": trailing bytes: shape needs 12 bytes, the file holds more");
    }
    SUBCASE("one trailing byte") {
        fs::resize_file(path, size + 1);
        CHECK(error_of<rpe::runtime_error>([&] { (void)rpe::io::load_npy(path); }) ==
              "[rpe.npy] " + path + ": trailing bytes: shape needs 12 bytes, the file holds more");
    }
    SUBCASE("the exact file still reads") { CHECK(rpe::io::load_npy(path).as<float>() == std::vector<float>{1.0f, 2.0f, 3.0f}); }
    SUBCASE("a header announcing more than 1 MiB of header text") {
        std::string bytes("\x93NUMPY\x02\x00\xff\xff\xff\x7f", 12);
        write_text(path, bytes + std::string(100, ' '));
        CHECK(error_of<rpe::runtime_error>([&] { (void)rpe::io::load_npy(path); }) ==
              "[rpe.npy] " + path + ": header length 2147483647 exceeds the 1048576 bytes this reader accepts");
    }
}

TEST_CASE("atomic writes: atomic_file removes its temporary file unless committed") {
    const scratch_dir dir;
    const std::string path = dir.file("out.txt");
    write_text(path, "old");
    SUBCASE("an exception between open and commit") {
        try {
            rpe::io::atomic_file f(path, "test");
            f.write(std::string_view("new, but never committed"));
            CHECK(dir.names().size() == 2);  // the target and the temporary file
            CHECK(contains(f.temporary(), path + ".tmp-"));
            throw std::runtime_error("stop");
        } catch (const std::runtime_error& e) {
            CHECK(std::string(e.what()) == "stop");
        }
        CHECK(read_text(path) == "old");
        CHECK(dir.names() == std::set<std::string>{"out.txt"});
    }
    SUBCASE("commit replaces the target; a second commit is refused") {
        rpe::io::atomic_file f(path, "test");
        f.write(std::string_view("new"));
        f.commit();
        CHECK(read_text(path) == "new");
        CHECK(f.temporary().empty());
        CHECK(error_of<rpe::runtime_error>([&] { f.commit(); }) ==
              "[rpe.test] " + path + ": the temporary file is already committed or discarded");
        CHECK(dir.names() == std::set<std::string>{"out.txt"});
    }
    SUBCASE("write_file_atomically writes text and bytes") {
        rpe::io::write_file_atomically(path, std::string_view("text"), "test");
        CHECK(read_text(path) == "text");
        const std::byte b[2] = {std::byte{'o'}, std::byte{'k'}};
        rpe::io::write_file_atomically(path, std::span<const std::byte>(b), "test");
        CHECK(read_text(path) == "ok");
        CHECK(dir.names() == std::set<std::string>{"out.txt"});
    }
}

namespace {

/// Forks a child that calls remove_temporaries_on_signals(), opens an atomic_file on `path` and
/// runs `body` with it (which should end by a signal); returns the child's wait status.
int status_of_child_writer(
    const std::string& path, const std::function<void(rpe::io::atomic_file&)>& body,
    const std::function<void()>& before = [] {}) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        default_signal_actions_in_child();
        try {
            before();
            rpe::io::remove_temporaries_on_signals();
            rpe::io::atomic_file f(path, "test");
            body(f);
        } catch (...) {
            ::_exit(3);
        }
        ::_exit(4);  // the signal did not end the child
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    return status;
}

}  // namespace

TEST_CASE("atomic writes: SIGINT, SIGTERM and SIGHUP remove the temporary file at every moment of a write") {
    const std::string chunk(1 << 16, 'x');
    for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
        CAPTURE(sig);
        // moments: right after the temporary file is created, after a first write, after many
        // writes (flushed to the file), and asynchronously from outside while the child writes
        for (int moment = 0; moment < 4; ++moment) {
            CAPTURE(moment);
            const scratch_dir dir;
            const std::string path = dir.file("out.npy");
            write_text(path, "old");
            int status = 0;
            if (moment < 3) {
                status = status_of_child_writer(path, [&](rpe::io::atomic_file& f) {
                    if (moment == 0) ::raise(sig);
                    f.write(std::string_view("new"));
                    if (moment == 1) ::raise(sig);
                    for (int i = 0; i < 64; ++i) f.write(std::string_view(chunk));  // 4 MiB, past stdio's buffer
                    ::raise(sig);
                });
            } else {
                const pid_t pid = ::fork();
                REQUIRE(pid >= 0);
                if (pid == 0) {
                    default_signal_actions_in_child();
                    try {
                        rpe::io::remove_temporaries_on_signals();
                        rpe::io::atomic_file f(path, "test");
                        for (;;) f.write(std::string_view(chunk));  // until the file-size limit or the signal
                    } catch (...) {
                        ::_exit(3);  // never back into doctest's runner in the child
                    }
                }
                // wait until the child's temporary file exists, then signal it mid-write
                for (int tries = 0; tries < 2000 && dir.names().size() < 2; ++tries) ::usleep(1000);
                CHECK(dir.names().size() == 2);
                ::usleep(20000);
                ::kill(pid, sig);
                ::waitpid(pid, &status, 0);
            }
            CHECK(WIFSIGNALED(status));
            CHECK(WTERMSIG(status) == sig);                          // the default disposition still ends the process
            CHECK(dir.names() == std::set<std::string>{"out.npy"});  // no temporary file left
            CHECK(read_text(path) == "old");
        }
    }
}

TEST_CASE("atomic writes: an ignored signal stays ignored, a program's own handler still runs after the cleanup") {
    const scratch_dir dir;
    const std::string path = dir.file("out.txt");
    write_text(path, "old");
    SUBCASE("SIGHUP ignored (nohup): the write goes on and commits") {
        const int status = status_of_child_writer(
            path,
            [](rpe::io::atomic_file& f) {
                ::raise(SIGHUP);
                f.write(std::string_view("new"));
                f.commit();
                ::_exit(0);
            },
            [] { std::signal(SIGHUP, SIG_IGN); });
        CHECK(WIFEXITED(status));
        CHECK(WEXITSTATUS(status) == 0);
        CHECK(read_text(path) == "new");
    }
    SUBCASE("a handler installed before runs after the temporary file is gone") {
        static const std::string* watched = nullptr;
        watched = &path;
        const int status = status_of_child_writer(
            path,
            [](rpe::io::atomic_file& f) {
                f.write(std::string_view("new"));
                ::raise(SIGTERM);
            },
            [] {
                std::signal(
                    SIGTERM, +[](int) {
                        // the temporary file is already removed when the program's handler runs
                        std::error_code ec;
                        int files = 0;
                        for (const auto& e : fs::directory_iterator(fs::path(*watched).parent_path(), ec)) (void)e, ++files;
                        ::_exit(files == 1 ? 42 : 43);
                    });
            });
        CHECK(WIFEXITED(status));
        CHECK(WEXITSTATUS(status) == 42);
    }
    CHECK(dir.names() == std::set<std::string>{"out.txt"});
}

// ---------------------------------------------------------------------------------------------
// Readers: extents 0, 2^31, 2^63 - 1 and overflowing products
// ---------------------------------------------------------------------------------------------
namespace {

std::vector<std::byte> npy_with_shape(const std::string& shape, std::size_t data_bytes = 0) {
    std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
    const std::size_t unpadded = 10 + header.size() + 1;
    header.append((64 - unpadded % 64) % 64, ' ');
    header += '\n';
    std::string file = std::string("\x93NUMPY\x01\x00", 8);
    file += static_cast<char>(header.size() & 0xff);
    file += static_cast<char>(header.size() >> 8);
    file += header;
    file.append(data_bytes, '\0');
    std::vector<std::byte> out(file.size());
    std::memcpy(out.data(), file.data(), file.size());
    return out;
}

std::vector<std::byte> safetensors_with_shape(const nlohmann::json& shape, std::size_t data_bytes = 0) {
    const nlohmann::json header = {{"t", {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {0, data_bytes}}}}};
    const std::string h = header.dump();
    std::vector<std::byte> out(8 + h.size() + data_bytes);
    for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<std::byte>((h.size() >> (8 * i)) & 0xff);
    std::memcpy(out.data() + 8, h.data(), h.size());
    return out;
}

}  // namespace

TEST_CASE("npy: extents 0, 2^31, 2^63-1 and overflowing products are checked before anything is sized") {
    using rpe::io::parse_npy;
    SUBCASE("zero-element arrays with moderate extents are valid (numpy writes them)") {
        const auto a = parse_npy(npy_with_shape("(0, 2147483648)"), "z.npy");
        CHECK(a.shape == std::vector<std::int64_t>{0, 2147483648});
        CHECK(a.size() == 0);
        CHECK(a.to<float>().empty());
        // the reproducer shape: 2^60 float32 for the non-zero extents is 2^62 bytes < 2^63
        CHECK(parse_npy(npy_with_shape("(549755813888, 2097152, 1, 0)"), "r.npy").size() == 0);
    }
    SUBCASE("an extent of 2^31 with no data is truncated data, not an allocation") {
        CHECK(error_of<rpe::runtime_error>([] { (void)parse_npy(npy_with_shape("(2147483648,)"), "big.npy"); }) ==
              "[rpe.npy] big.npy: data truncated: shape needs 8589934592 bytes, file holds 0");
    }
    SUBCASE("2^63 - 1 alone, or a product of non-zero extents beyond int64, with or without a 0") {
        CHECK(error_of<rpe::runtime_error>([] { (void)parse_npy(npy_with_shape("(9223372036854775807,)"), "m.npy"); }) ==
              "[rpe.npy] m.npy: shape product overflows: 1 * 9223372036854775807 elements of 4 bytes exceed int64 (the "
              "product of the non-zero extents must fit, as numpy requires, even when an extent is 0)");
        CHECK(
            contains(error_of<rpe::runtime_error>([] { (void)parse_npy(npy_with_shape("(9223372036854775807, 0)"), "m0.npy"); }),
                     "[rpe.npy] m0.npy: shape product overflows: 1 * 9223372036854775807"));
        CHECK(contains(
            error_of<rpe::runtime_error>([] { (void)parse_npy(npy_with_shape("(4294967296, 4294967296, 0)"), "p.npy"); }),
            "[rpe.npy] p.npy: shape product overflows: 4294967296 * 4294967296"));
        CHECK(contains(
            error_of<rpe::runtime_error>([] { (void)parse_npy(npy_with_shape("(0, 3037000500, 3037000500)"), "q.npy"); }),
            "shape product overflows: 3037000500 * 3037000500"));
        CHECK(contains(error_of<rpe::runtime_error>([] { (void)parse_npy(npy_with_shape("(9223372036854775808,)"), "o.npy"); }),
                       "extent in 'shape' overflows int64"));
    }
    SUBCASE("encode_npy refuses what parse_npy would refuse") {
        const std::int64_t s[] = {4294967296, 4294967296, 0};
        CHECK(error_of<rpe::invalid_argument>([&] { (void)rpe::io::encode_npy<float>(nullptr, s); }) ==
              "[rpe.npy] element count overflows int64");
        const std::int64_t ok[] = {0, 2147483648};
        CHECK(rpe::io::parse_npy(rpe::io::encode_npy<float>(nullptr, ok), "ok.npy").shape ==
              std::vector<std::int64_t>{0, 2147483648});
    }
}

TEST_CASE("safetensors: extents 0, 2^31, 2^63-1 and overflowing products are checked before anything is sized") {
    using rpe::io::safetensors_file;
    using json = nlohmann::json;
    SUBCASE("zero-element tensors with moderate extents are valid") {
        const auto f = safetensors_file::parse(safetensors_with_shape(json::array({0, 2147483648LL})), "z.st");
        CHECK(f.info("t").shape == std::vector<std::int64_t>{0, 2147483648});
        CHECK(f.to_vector<float>("t").empty());
    }
    SUBCASE("an extent of 2^31 with no data does not match its offsets") {
        CHECK(error_of<rpe::runtime_error>([] {
                  (void)safetensors_file::parse(safetensors_with_shape(json::array({2147483648LL})), "b.st");
              }) == "[rpe.safetensors] b.st: entry 't': holds 0 bytes, but shape (2147483648,) of F32 needs 8589934592");
    }
    SUBCASE("2^63 - 1, or a product of non-zero extents beyond int64, with or without a 0") {
        CHECK(error_of<rpe::runtime_error>(
                  [] { (void)safetensors_file::parse(safetensors_with_shape(json::array({9223372036854775807LL})), "m.st"); }) ==
              "[rpe.safetensors] m.st: entry 't': shape product overflows: 1 * 9223372036854775807 elements of 4 bytes "
              "exceed int64 (the product of the non-zero extents must fit, even when an extent is 0)");
        CHECK(contains(
            error_of<rpe::runtime_error>([] {
                (void)safetensors_file::parse(safetensors_with_shape(json::array({4294967296LL, 4294967296LL, 0})), "p.st");
            }),
            "entry 't': shape product overflows: 4294967296 * 4294967296"));
        CHECK(contains(
            error_of<rpe::runtime_error>([] {
                (void)safetensors_file::parse(safetensors_with_shape(json::array({0, 3037000500LL, 3037000500LL})), "q.st");
            }),
            "shape product overflows: 3037000500 * 3037000500"));
        CHECK(contains(error_of<rpe::runtime_error>([] {
                           (void)safetensors_file::parse(safetensors_with_shape(json::array({9223372036854775808ULL})), "o.st");
                       }),
                       "extent 9223372036854775808 overflows int64"));
    }
    SUBCASE("more than 64 extents") {
        CHECK(error_of<rpe::runtime_error>([] {
                  (void)safetensors_file::parse(safetensors_with_shape(json(std::vector<int>(65, 1))), "r.st");
              }) == "[rpe.safetensors] r.st: entry 't': 'shape' has 65 extents; expected at most 64");
    }
}

// ---------------------------------------------------------------------------------------------
// Enum parameters
// ---------------------------------------------------------------------------------------------
TEST_CASE("errors: enum parameters outside their enumerators are refused, naming the value") {
    const rpe::mapping::product<> m{rpe::index::piecewise::from_ratio(1.9)};
    const auto bad_storage = static_cast<rpe::id_storage>(7);
    const std::string storage_msg = "[rpe.bucket_ids] storage = 7; expected automatic, table or on_the_fly";
    SUBCASE("id_storage in build_bucket_ids: no 4.3 GB table attempted") {
        CHECK(error_of<rpe::invalid_argument>([&] { (void)rpe::build_bucket_ids(m, 256, 256, 1, bad_storage); }) == storage_msg);
        CHECK(error_of<rpe::invalid_argument>([&] {
                  (void)rpe::build_bucket_ids(m, 1, 3, 3, 0, static_cast<rpe::id_storage>(-1));
              }) == "[rpe.bucket_ids] storage = -1; expected automatic, table or on_the_fly");
    }
    SUBCASE("id_storage in bucket_cache::get: no entry is made") {
        rpe::bucket_cache cache;
        CHECK(error_of<rpe::invalid_argument>([&] { (void)cache.get(m, 3, 3, 1, bad_storage); }) == storage_msg);
        CHECK(cache.size() == 0);
        CHECK(cache.builds() == 0);
    }
    const rpe::term<rpe::mapping::product<>, rpe::mode::contextual, rpe::target::key> t(m, {.num_heads = 1, .head_dim = 2});
    SUBCASE("id_storage in a term's bucket_ids") {
        CHECK(error_of<rpe::invalid_argument>([&] { (void)t.bucket_ids(1, 3, 3, bad_storage); }) == storage_msg);
    }
    const int L = 9, D = 2, K = t.num_buckets();
    std::vector<float> table(static_cast<std::size_t>(D * K), 0.5f), x(static_cast<std::size_t>(L * D), 1.0f);
    std::vector<float> q(static_cast<std::size_t>(L * D), 1.0f), out(static_cast<std::size_t>(L * D), -3.0f);
    const auto ids = t.bucket_ids(3, 3);
    SUBCASE("write mode in term forward and backward: nothing written") {
        std::vector<float> logits(static_cast<std::size_t>(L * L), -3.0f);
        const rpe::tensor_ref<const float> tab(table.data(), {1, D, K});
        const rpe::tensor_ref<const float> xs(x.data(), {1, 1, L, D});
        CHECK(error_of<rpe::invalid_argument>([&] {
                  t.forward(*ids, {tab}, xs, rpe::tensor_ref<float>(logits.data(), {1, 1, L, L}), static_cast<rpe::write>(2));
              }) == "[rpe.term] mode = 2; expected write::overwrite or write::accumulate");
        CHECK(std::all_of(logits.begin(), logits.end(), [](float v) { return v == -3.0f; }));
        std::vector<float> grad_x(x.size(), -3.0f), grad_t(table.size(), -3.0f);
        CHECK(error_of<rpe::invalid_argument>([&] {
                  t.backward(*ids, {tab}, xs, rpe::tensor_ref<const float>(logits.data(), {1, 1, L, L}),
                             rpe::tensor_ref<float>(grad_x.data(), {1, 1, L, D}),
                             {rpe::tensor_ref<float>(grad_t.data(), {1, D, K})}, static_cast<rpe::write>(9));
              }) == "[rpe.term] mode = 9; expected write::overwrite or write::accumulate");
        CHECK(std::all_of(grad_x.begin(), grad_x.end(), [](float v) { return v == -3.0f; }));
        CHECK(std::all_of(grad_t.begin(), grad_t.end(), [](float v) { return v == -3.0f; }));
    }
    SUBCASE("attention_options::storage in the fused forward and backward: nothing written, nothing cached") {
        const auto term = rpe::make_any_term(t);
        rpe::attention_inputs<float> in;
        in.q = {q.data(), {1, 1, L, D}};
        in.k = {q.data(), {1, 1, L, D}};
        in.v = {q.data(), {1, 1, L, D}};
        in.height = 3;
        in.width = 3;
        in.rpe_k.term = term.get();
        in.rpe_k.tables = {rpe::tensor_ref<const float>(table.data(), {1, D, K})};
        rpe::attention_options opt;
        opt.storage = bad_storage;
        const std::size_t cached = rpe::bucket_cache::global().size();
        CHECK(error_of<rpe::invalid_argument>([&] {
                  rpe::attention_forward(in, rpe::tensor_ref<float>(out.data(), {1, 1, L, D}), {}, opt);
              }) == "[rpe.attention] options.storage = 7; expected automatic, table or on_the_fly");
        CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == -3.0f; }));
        std::vector<float> gq(q.size(), -3.0f), gk(q.size(), -3.0f), gv(q.size(), -3.0f);
        CHECK(error_of<rpe::invalid_argument>([&] {
                  rpe::attention_backward(
                      in, rpe::tensor_ref<const float>(q.data(), {1, 1, L, D}), rpe::tensor_ref<float>(gq.data(), {1, 1, L, D}),
                      rpe::tensor_ref<float>(gk.data(), {1, 1, L, D}), rpe::tensor_ref<float>(gv.data(), {1, 1, L, D}), opt);
              }) == "[rpe.attention] options.storage = 7; expected automatic, table or on_the_fly");
        CHECK(std::all_of(gq.begin(), gq.end(), [](float v) { return v == -3.0f; }));
        CHECK(rpe::bucket_cache::global().size() == cached);
    }
    SUBCASE("method, index and target of a term_spec") {
        rpe::term_spec s;
        s.method = static_cast<rpe::method>(6);
        CHECK(error_of<rpe::invalid_argument>([&] { (void)rpe::make_term<float>(s); }) ==
              "[rpe.term_spec] method = 6; expected euclidean, quantization, cross, product, euclidean_paper or "
              "quantization_paper");
        s = {};
        s.index = static_cast<rpe::index_kind>(7);  // was taken as clip
        CHECK(error_of<rpe::invalid_argument>([&] { (void)s.num_buckets(); }) ==
              "[rpe.term_spec] index = 7; expected piecewise or clip");
        s = {};
        s.target = static_cast<rpe::target>(3);
        CHECK(error_of<rpe::invalid_argument>([&] { (void)rpe::make_term<double>(s); }) ==
              "[rpe.term_spec] target = 3; expected query, key or value");
        CHECK_NOTHROW((void)rpe::make_term<float>(rpe::term_spec{}));
    }
}

// ---------------------------------------------------------------------------------------------
// α, β, γ the float math of index::piecewise cannot use
// ---------------------------------------------------------------------------------------------
TEST_CASE("errors: alpha whose float32 underflows, gamma / alpha that overflows double") {
    using rpe::index::piecewise;
    constexpr float flt_min = std::numeric_limits<float>::min();
    SUBCASE("float(alpha) = 0: the index would divide by zero") {
        CHECK(error_of<rpe::invalid_argument>([] {
                  piecewise{1e-310, 3.8, 15.2}.validate();
              }) ==
              "[rpe.index.piecewise] alpha = 9.9999999999999694e-311 underflows float32 (float(alpha) = 0, the index "
              "divides by it); expected float(alpha) >= 1.1754943508222875e-38, the smallest normal float32");
        CHECK(contains(error_of<rpe::invalid_argument>([] {
                           piecewise{4.9406564584124654e-324, 244199215.5, 244223557.4}.validate();
                       }),
                       "underflows float32 (float(alpha) = 0"));
    }
    SUBCASE("float(alpha) subnormal: 0 wherever subnormals are flushed") {
        CHECK(contains(error_of<rpe::invalid_argument>([] {
                           piecewise{1e-39, 3.8, 15.2}.validate();
                       }),
                       "alpha = 9.9999999999999993e-40 underflows float32 (float(alpha) = 1.0000002153053333e-39"));
        CHECK(contains(error_of<rpe::invalid_argument>([] {
                           piecewise{static_cast<double>(flt_min) * 0.5, 1.0, 2.0}.validate();
                       }),
                       "underflows float32"));
    }
    SUBCASE("the smallest normal float32 is accepted and gives in-range indices") {
        const piecewise g{static_cast<double>(flt_min), 3.8, 15.2};
        CHECK_NOTHROW(g.validate());
        CHECK(g(std::int64_t{0}) == 0);
        CHECK(g(std::int64_t{1}) == 3);  // |x| / α overflows float to inf: the cap, as the math says
        CHECK(g(std::int64_t{-7}) == -3);
    }
    SUBCASE("gamma / alpha beyond double: ln(gamma / alpha) would be infinite") {
        CHECK(error_of<rpe::invalid_argument>([] {
                  piecewise{1e-10, 3.8, 1e300}.validate();
              }) ==
              "[rpe.index.piecewise] gamma / alpha = 1.0000000000000001e+300 / 1e-10 overflows double (ln(gamma / alpha) "
              "would be infinite); expected gamma / alpha <= 1.7976931348623157e+308");
        CHECK_NOTHROW((piecewise{1.0, 3.8, 1e300}.validate()));
    }
    SUBCASE("the same checks through term_spec, the term and the bucket-id builder") {
        rpe::term_spec s;
        s.ratio(1e-310);
        CHECK(contains(error_of<rpe::invalid_argument>([&] { (void)s.num_buckets(); }), "[rpe.term_spec] alpha = "));
        CHECK(contains(error_of<rpe::invalid_argument>([&] { (void)rpe::make_term<float>(s); }), "underflows float32"));
        const rpe::mapping::product<> m{piecewise::from_ratio(1e-310)};
        CHECK(contains(error_of<rpe::invalid_argument>([&] { (void)rpe::build_bucket_ids(m, 3, 3, 0); }), "underflows float32"));
    }
}

}  // namespace rpe_unit_robustness_io
