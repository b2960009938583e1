#pragma once
// Metrics as JSON lines: one object per line, appended and flushed as each epoch ends, so a crashed run
// keeps every finished epoch and a plot script (scripts/plot_metrics.py) can read the file while
// training goes on. A resumed run continues the file from its checkpoint's epoch.
#include "fusedp/core/error.hpp"
#include "fusedp/train/durable_file.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>
#include <variant>

namespace fusedp::train {

class MetricsWriter {
 public:
  using Value = std::variant<double, long long, std::string>;

  MetricsWriter() = default;
  /// Opens `path` for writing (truncating it). Throws DataError when it cannot be opened.
  explicit MetricsWriter(const std::string& path) : path_(path), out_(path, std::ios::trunc) {
    if (!out_) throw DataError(path, "cannot open the metrics file for writing");
  }

  /// Continues the metrics file of a resumed run: keeps the lines whose "epoch" is at most
  /// `epochs_done` (what the checkpoint holds) and lines without an epoch, drops the later epochs that
  /// the interrupted run wrote after its last checkpoint and a last line it did not finish, and appends
  /// from there. The file is
  /// rewritten atomically; a missing file starts empty.
  [[nodiscard]] static MetricsWriter resume(const std::string& path, std::uint64_t epochs_done) {
    std::string kept;
    if (std::ifstream in{path}; in) {
      for (std::string line; std::getline(in, line);) {
        // A line the interrupted run did not finish (no newline after it, or the zeros a lost write
        // leaves) is dropped: kept, it would break every later read of the file.
        if (in.eof() || line.find('\0') != std::string::npos) continue;
        if (line.empty()) continue;
        const std::size_t at = line.find("\"epoch\": ");
        if (at != std::string::npos) {
          const std::string digits = line.substr(at + 9, line.find_first_not_of("0123456789", at + 9) - (at + 9));
          if (!digits.empty() && digits.size() < 19 && std::stoull(digits) > epochs_done) continue;
        }
        kept += line + "\n";
      }
      if (in.bad()) throw DataError(path, "reading the metrics file failed");
    }
    write_file_atomically(path, {reinterpret_cast<const std::uint8_t*>(kept.data()), kept.size()});
    MetricsWriter w;
    w.path_ = path;
    w.out_.open(path, std::ios::app);
    if (!w.out_) throw DataError(path, "cannot open the metrics file for appending");
    return w;
  }

  [[nodiscard]] bool enabled() const { return out_.is_open(); }

  /// Writes one JSON object with the given fields, in order.
  void write(std::initializer_list<std::pair<const char*, Value>> fields) {
    if (!enabled()) return;
    std::ostringstream line;
    line << '{';
    bool first = true;
    for (const auto& [key, value] : fields) {
      line << (first ? "" : ", ") << '"' << key << "\": ";
      first = false;
      if (const double* d = std::get_if<double>(&value)) {
        if (std::isfinite(*d)) {
          char buf[32];
          std::snprintf(buf, sizeof buf, "%.9g", *d);
          line << buf;
        } else {
          line << "null";  // JSON has no NaN or Infinity
        }
      } else if (const long long* i = std::get_if<long long>(&value)) {
        line << *i;
      } else {
        line << '"' << escape(std::get<std::string>(value)) << '"';
      }
    }
    line << "}\n";
    out_ << line.str();
    out_.flush();
    if (!out_) throw DataError(path_, "writing the metrics file failed");
  }

 private:
  static std::string escape(const std::string& s) {
    std::string r;
    for (char c : s) {
      if (c == '"' || c == '\\') r += '\\';
      if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        r += buf;
      } else {
        r += c;
      }
    }
    return r;
  }
  std::string path_;
  std::ofstream out_;
};

}  // namespace fusedp::train
