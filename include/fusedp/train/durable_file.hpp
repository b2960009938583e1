#pragma once
// Writing files so that a crash or a full disk never leaves a half-written file under the real name:
// write a temporary file in the same folder, fsync it, rename it over the target, fsync the folder
// (POSIX; rename within one file system is atomic).
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <span>
#include <string>
#include <system_error>

namespace fusedp::train {

namespace detail {

inline std::string errno_text(int err) { return std::generic_category().message(err); }

/// Opens, fsyncs and closes the folder `dir`, so a rename inside it survives a power loss.
inline void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    throw DataError(dir, "cannot open the folder to sync it: " + errno_text(err));
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some file systems cannot sync a folder (EINVAL); the rename itself has happened then.
  if (rc != 0 && err != EINVAL) throw DataError(dir, "syncing the folder failed: " + errno_text(err));
}

/// Writes `bytes` to a new file `path` (replacing any stale one) and fsyncs it. On failure the file
/// is removed and a DataError names it and the reason (no space, quota, permission, ...).
inline void write_synced(const std::string& path, std::span<const std::uint8_t> bytes) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    const int err = errno;
    throw DataError(path, "cannot remove a stale temporary file: " + errno_text(err));
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    throw DataError(path, "cannot create the file: " + errno_text(err));
  }
  auto fail = [&](const std::string& what, int err) {
    ::close(fd);
    ::unlink(path.c_str());
    throw DataError(path, what + ": " + errno_text(err));
  };
  std::size_t done = 0;
  while (done < bytes.size()) {
    const std::size_t chunk = std::min<std::size_t>(bytes.size() - done, std::size_t{1} << 30);
    const ::ssize_t n = ::write(fd, bytes.data() + done, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("writing failed after " + std::to_string(done) + " of " + std::to_string(bytes.size()) + " bytes", errno);
    }
    if (n == 0) fail("writing failed after " + std::to_string(done) + " bytes", EIO);
    done += std::size_t(n);
  }
  if (::fsync(fd) != 0) fail("fsync failed", errno);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(path.c_str());
    throw DataError(path, "closing the file failed: " + errno_text(err));
  }
}

/// Renames `from` over `to` (atomic within a folder).
inline void rename_over(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    const int err = errno;
    throw DataError(to, "cannot rename " + from + " over it: " + errno_text(err));
  }
}

inline std::string parent_folder(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

}  // namespace detail

/// Replaces `path` by a file holding `bytes`, atomically: readers see the old file or the new one,
/// never a mix, and a failure (or a crash) before the rename leaves the old file untouched. The
/// temporary file is `path` + ".tmp", in the same folder.
inline void write_file_atomically(const std::string& path, std::span<const std::uint8_t> bytes) {
  const std::string tmp = path + ".tmp";
  detail::write_synced(tmp, bytes);
  try {
    detail::rename_over(tmp, path);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  detail::fsync_directory(detail::parent_folder(path));
}

}  // namespace fusedp::train
