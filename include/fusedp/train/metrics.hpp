#pragma once
// Metrics as JSON lines: one object per line, appended and flushed as each epoch ends, so a crashed run
// keeps every finished epoch and a plot script can read the file while training goes on.
#include "fusedp/core/error.hpp"

#include <cmath>
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
