#pragma once
// Shared by the libFuzzer targets in tests/fuzz/ (see run.sh): files in memory for the readers to
// open by path, splitting one fuzz input into several files, and the rule every target enforces —
// a hostile file may only end in a fusedp::DataError naming that file; any other exception, a
// DataError naming something else, or a broken postcondition aborts, and libFuzzer keeps the input.
#include "fusedp/core/error.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

namespace fusedp_fuzz {

using Bytes = std::vector<std::uint8_t>;

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "\nfusedp fuzz: PROMISE BROKEN: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

inline void check(bool condition, const std::string& what) {
  if (!condition) fail(what);
}

/// A file whose contents live in memory (memfd), opened by the readers through /proc/self/fd/N
/// like any path; rewritten for every input. Falls back to a temporary file where memfd is missing.
class MemFile {
 public:
  explicit MemFile(const char* name) {
    fd_ = ::memfd_create(name, MFD_CLOEXEC);
    if (fd_ >= 0) {
      path_ = "/proc/self/fd/" + std::to_string(fd_);
      return;
    }
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/fusedp-fuzz-" + name + "-XXXXXX";
    fd_ = ::mkstemp(templ.data());
    if (fd_ < 0) fail("cannot create a temporary file: " + std::string(std::strerror(errno)));
    path_ = templ;
    unlink_ = true;
  }
  ~MemFile() {
    ::close(fd_);
    if (unlink_) ::unlink(path_.c_str());
  }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;

  void write(std::span<const std::uint8_t> bytes) {
    if (::ftruncate(fd_, 0) != 0) fail("ftruncate failed: " + std::string(std::strerror(errno)));
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ::ssize_t n = ::pwrite(fd_, bytes.data() + done, bytes.size() - done, ::off_t(done));
      if (n <= 0) fail("pwrite failed: " + std::string(std::strerror(errno)));
      done += std::size_t(n);
    }
  }
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
  bool unlink_ = false;
};

/// A private folder for targets that read folders (checkpoints): under $FUSEDP_FUZZ_SCRATCH (run.sh
/// sets it to a folder it removes, since a crash skips the destructor), else /dev/shm (memory) when
/// it is there, else TMPDIR; removed at exit.
class ScratchDir {
 public:
  ScratchDir() {
    namespace fs = std::filesystem;
    const char* scratch = std::getenv("FUSEDP_FUZZ_SCRATCH");
    const char* tmp = std::getenv("TMPDIR");
    std::error_code ec;
    const std::string base = scratch && *scratch ? std::string(scratch)
                             : fs::is_directory("/dev/shm", ec) && ::access("/dev/shm", W_OK) == 0
                                 ? std::string("/dev/shm")
                                 : std::string(tmp && *tmp ? tmp : "/tmp");
    std::string templ = base + "/fusedp-fuzz-XXXXXX";
    if (!::mkdtemp(templ.data())) fail("cannot create a scratch folder: " + std::string(std::strerror(errno)));
    path_ = templ;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

/// Where one fuzz input is cut into several files. memmem, so that libFuzzer's comparison hooks
/// learn the separator.
inline constexpr std::string_view separator = "FUZZSPLIT";

/// The parts of `data` between separators (one part when there is none).
inline std::vector<Bytes> split(std::span<const std::uint8_t> data, std::size_t max_parts) {
  std::vector<Bytes> parts;
  const std::uint8_t* p = data.data();
  std::size_t left = data.size();
  while (parts.size() + 1 < max_parts) {
    const void* hit = left ? ::memmem(p, left, separator.data(), separator.size()) : nullptr;
    if (!hit) break;
    const auto n = std::size_t(static_cast<const std::uint8_t*>(hit) - p);
    parts.emplace_back(p, p + n);
    p += n + separator.size();
    left -= n + separator.size();
  }
  parts.emplace_back(p, p + left);
  return parts;
}

/// The inverse of split, for the seed generator.
inline Bytes join(std::initializer_list<Bytes> parts) {
  Bytes out;
  bool first = true;
  for (const Bytes& b : parts) {
    if (!first) out.insert(out.end(), separator.begin(), separator.end());
    out.insert(out.end(), b.begin(), b.end());
    first = false;
  }
  return out;
}

/// Runs `f`. Returns true when it returned, false when it threw a fusedp::DataError whose path is
/// one of `paths` (or inside one of them, for folders) and whose message starts with that path.
/// Anything else thrown is a broken promise.
template <class F>
bool expect_data_error(F&& f, std::initializer_list<std::string_view> paths) {
  try {
    f();
    return true;
  } catch (const fusedp::DataError& e) {
    const std::string& p = e.path();
    bool named = false;
    for (std::string_view allowed : paths)
      named = named || std::string_view(p).substr(0, allowed.size()) == allowed;
    if (!named) fail("DataError names '" + p + "', which is not a file this input made: " + e.what());
    if (std::string_view(e.what()).substr(0, p.size()) != p) fail("DataError message does not start with its path");
    return false;
  } catch (const fusedp::Error& e) {
    fail(std::string("a fusedp::Error that is not a DataError (") + typeid(e).name() + "): " + e.what());
  } catch (const std::exception& e) {
    fail(std::string("an exception that is not a fusedp::Error (") + typeid(e).name() + "): " + e.what());
  } catch (...) {
    fail("an exception that is not a std::exception");
  }
}

}  // namespace fusedp_fuzz
