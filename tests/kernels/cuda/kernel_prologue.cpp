// The contract of kernels/cuda/launch.cuh, checked on the sources (no GPU needed): every __global__
// function in include/fusedp begins with kernel_prologue(), and no header launches with <<<...>>>
// (every launch goes through launch<kernel>, which may make it a programmatic dependent launch). A
// kernel without the prologue that is launched dependently could read its predecessor's output before
// it is written, and would break the transitive order the other kernels rely on: a race that only a
// GPU shows, and only sometimes. The one exception is exec/cuda_check.hpp's probe_kernel, an empty
// kernel launched plainly to ask whether the device can load this build's code.
#include <doctest/doctest.h>

#include <fusedp/kernels/cuda/launch.cuh>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

fs::path include_dir() {
  const char* root = std::getenv("FUSEDP_SOURCE_DIR");
  REQUIRE_MESSAGE(root != nullptr, "FUSEDP_SOURCE_DIR is not set (ctest sets it to the source root)");
  return fs::path(root) / "include" / "fusedp";
}

// The text with // and /* */ comments replaced by spaces (string and character literals kept, and
// skipped: a '"' must not open a string, nor a "//" in a string a comment). A ' after a letter or digit
// is a digit separator (1'000), not a character literal.
std::string without_comments(const std::string& s) {
  std::string out = s;
  for (std::size_t i = 0; i + 1 < out.size(); ++i) {
    const bool char_literal = out[i] == '\'' && (i == 0 || !std::isalnum(static_cast<unsigned char>(out[i - 1])));
    if (out[i] == '"' || char_literal) {
      const char close = out[i];
      for (++i; i < out.size() && out[i] != close; ++i)
        if (out[i] == '\\') ++i;
    } else if (out[i] == '/' && out[i + 1] == '/') {
      for (; i < out.size() && out[i] != '\n'; ++i) out[i] = ' ';
    } else if (out[i] == '/' && out[i + 1] == '*') {
      for (; i + 1 < out.size() && !(out[i] == '*' && out[i + 1] == '/'); ++i)
        if (out[i] != '\n') out[i] = ' ';
      if (i + 1 < out.size()) out[i] = out[i + 1] = ' ';
    }
  }
  return out;
}

struct Kernel {
  std::string file, name, first_statement;
  int line = 0;
};

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int line_of(const std::string& s, std::size_t pos) { return 1 + int(std::count(s.begin(), s.begin() + long(pos), '\n')); }

// Every __global__ function definition in `text`: its name (the identifier before the parameter list)
// and the first statement of its body, whitespace squeezed.
std::vector<Kernel> kernels_in(const std::string& file, const std::string& text) {
  std::vector<Kernel> out;
  for (std::size_t at = text.find("__global__"); at != std::string::npos; at = text.find("__global__", at + 1)) {
    // The parameter list: the first parenthesis after __global__ that does not belong to
    // __launch_bounds__(...).
    std::size_t open = text.find('(', at), name_begin = 0, name_end = 0, close = 0;
    for (;;) {
      if (open == std::string::npos) return out;
      name_end = open;
      while (name_end > at && std::isspace(static_cast<unsigned char>(text[name_end - 1]))) --name_end;
      name_begin = name_end;
      while (name_begin > at &&
             (std::isalnum(static_cast<unsigned char>(text[name_begin - 1])) || text[name_begin - 1] == '_'))
        --name_begin;
      int depth = 0;
      for (close = open; close < text.size(); ++close) {
        if (text[close] == '(') ++depth;
        if (text[close] == ')' && --depth == 0) break;
      }
      if (text.compare(name_begin, name_end - name_begin, "__launch_bounds__") != 0) break;
      open = text.find('(', close);
    }
    const std::size_t brace = text.find_first_of("{;", close);
    if (brace == std::string::npos || text[brace] == ';') continue;  // a declaration
    const std::size_t end = text.find_first_of(";}", brace + 1);
    std::string first;
    for (std::size_t i = brace + 1; i <= end && i < text.size(); ++i)
      if (!std::isspace(static_cast<unsigned char>(text[i]))) first += text[i];
    out.push_back({file, text.substr(name_begin, name_end - name_begin), first, line_of(text, at)});
  }
  return out;
}

}  // namespace

TEST_CASE("every kernel in include/fusedp begins with kernel_prologue() and launches through launch<>") {
  const fs::path dir = include_dir();
  REQUIRE(fs::is_directory(dir));
  std::vector<Kernel> kernels;
  int launch_sites = 0;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const std::string ext = entry.path().extension().string();
    if (ext != ".hpp" && ext != ".cuh") continue;
    const std::string file = fs::relative(entry.path(), dir).generic_string();
    const std::string text = without_comments(read(entry.path()));
    for (auto& k : kernels_in(file, text)) kernels.push_back(k);
    for (std::size_t at = text.find("<<<"); at != std::string::npos; at = text.find("<<<", at + 3)) {
      const std::size_t line_begin = text.rfind('\n', at) + 1;
      const std::string line = text.substr(line_begin, text.find('\n', at) - line_begin);
      INFO(file, ":", line_of(text, at), ": ", line);
      CHECK_MESSAGE(line.find("probe_kernel") != std::string::npos,
                    "a <<<...>>> launch: use kernels::cuda::launch<kernel>(...) (kernels/cuda/launch.cuh)");
    }
    for (std::size_t at = text.find("launch<"); at != std::string::npos; at = text.find("launch<", at + 1)) ++launch_sites;
  }
  MESSAGE(kernels.size(), " kernels, ", launch_sites, " launch<> sites");
  CHECK(kernels.size() >= 30);  // the scan finds them (37 when this test was written)
  CHECK(launch_sites >= 30);
  for (const auto& k : kernels) {
    INFO(k.file, ":", k.line, ": kernel ", k.name, " begins with '", k.first_statement, "'");
    if (k.name == "probe_kernel") continue;
    CHECK_MESSAGE(k.first_statement == "kernel_prologue();",
                  "a kernel must begin with kernel_prologue() (kernels/cuda/launch.cuh): launched dependently "
                  "without it, it may read its predecessor's output before it is written");
  }
}

TEST_CASE("the scan itself: finds a kernel, its name and its first statement, past comments and launch bounds") {
  const std::string text = without_comments(
      "// __global__ void commented() {}\n"
      "template <int N>\n__global__ void __launch_bounds__(256, 2) good(const int* x) {\n"
      "  kernel_prologue();  // first\n  x[0];\n}\n"
      "__global__ void bad(int n) { /* no prologue */ int i = n; }\n"
      "__global__ void declared(int);\n");
  const auto k = kernels_in("t.cuh", text);
  REQUIRE(k.size() == 2);
  CHECK(k[0].name == "good");
  CHECK(k[0].first_statement == "kernel_prologue();");
  CHECK(k[1].name == "bad");
  CHECK(k[1].first_statement == "inti=n;");
  CHECK(k[1].line == 7);
}

TEST_CASE("the scan itself: a quote in a character literal opens no string, a digit separator no literal") {
  // exec/trace.hpp writes '"' in JSON: read as a string's start, it kept the comments up to the next
  // quote (a commented-out kernel was a kernel without the prologue) and took strings for code.
  const std::string text = without_comments(
      "inline char quote() { return '\"'; }\n"
      "// __global__ void commented_out(int n) { int i = n; }\n"
      "constexpr int n = 1'000;\n"
      "__global__ void after_quote(int n) { int i = n; }\n"
      "const char* s = \"// not a comment\";\n"
      "__global__ void after_string(int n) { kernel_prologue(); }\n");
  const auto k = kernels_in("t.cuh", text);
  REQUIRE(k.size() == 2);
  CHECK(k[0].name == "after_quote");
  CHECK(k[0].first_statement == "inti=n;");
  CHECK(k[0].line == 4);
  CHECK(k[1].name == "after_string");
  CHECK(k[1].first_statement == "kernel_prologue();");
}

TEST_CASE("FUSEDP_CUDA_DEPENDENT_LAUNCH: on when unset, off by 'off' or '0', anything else is an error naming it") {
  namespace kc = fusedp::kernels::cuda;
  CHECK(kc::parse_dependent_launch(nullptr));
  CHECK(kc::parse_dependent_launch(""));
  CHECK(kc::parse_dependent_launch("on"));
  CHECK(kc::parse_dependent_launch("1"));
  CHECK_FALSE(kc::parse_dependent_launch("off"));
  CHECK_FALSE(kc::parse_dependent_launch("0"));
  CHECK_THROWS_WITH_AS((void)kc::parse_dependent_launch("yes please"),
                       doctest::Contains("FUSEDP_CUDA_DEPENDENT_LAUNCH is 'yes please'"), fusedp::InvalidArgument);
}
