// nvcc compiles a .cu file's device code with its own front end and its host code with the host
// compiler, and each evaluates the library's compile-time plans on its own; they have disagreed
// (net/residual.hpp: adds_before_epilogue). plan_agreement.cu is compiled to PTX by nvcc: its kernel I
// stores case I's CudaPlanFingerprint as the device code has it. This test, compiled by the host
// compiler, reads those constants from the PTX text and compares them with its own. No GPU needed; a
// Cuda model makes the same comparison on the device when it is built (net/cuda_model.hpp).
#include <doctest/doctest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <utility>

#include "networks.hpp"

namespace {

// Kernel index -> the 64-bit immediate it stores (PTX writes it as a signed decimal).
std::map<std::size_t, std::uint64_t> device_fingerprints(const std::string& ptx) {
  std::map<std::size_t, std::uint64_t> r;
  const std::regex entry(R"(\.entry\s+_Z\d+plan_fingerprint_caseILm(\d+)EE)");
  const std::regex value(R"(mov\.[ub]64\s+%rd\d+,\s*(-?\d+)\s*;)");
  for (auto it = std::sregex_iterator(ptx.begin(), ptx.end(), entry); it != std::sregex_iterator(); ++it) {
    const std::size_t index = std::stoull((*it)[1].str());
    const std::size_t body = std::size_t(it->position(0) + it->length(0));
    const std::size_t end = ptx.find("ret;", body);
    std::smatch m;
    const std::string text = ptx.substr(body, end == std::string::npos ? std::string::npos : end - body);
    if (std::regex_search(text, m, value)) r[index] = std::uint64_t(std::stoll(m[1].str()));
  }
  return r;
}

template <std::size_t... I>
constexpr std::array<std::uint64_t, sizeof...(I)> host_fingerprints(std::index_sequence<I...>) {
  return {plan_agreement::fingerprint_of<I>::value...};
}

}  // namespace

TEST_CASE("nvcc's device code and the host compiler plan every network alike") {
  std::ifstream in(FUSEDP_PLAN_AGREEMENT_PTX);
  REQUIRE_MESSAGE(in.good(), "cannot read " FUSEDP_PLAN_AGREEMENT_PTX);
  std::stringstream text;
  text << in.rdbuf();
  const std::map<std::size_t, std::uint64_t> device = device_fingerprints(text.str());
  constexpr auto host = host_fingerprints(std::make_index_sequence<plan_agreement::case_count>{});
  REQUIRE(device.size() == host.size());
  constexpr std::array<const char*, 3> precisions{"Tf32", "Bf16", "Fp32"};
  for (std::size_t i = 0; i < host.size(); ++i) {
    INFO("case ", i, ": network ", i / 3, " of networks.hpp's Cases in ", precisions[i % 3]);
    REQUIRE(device.count(i) == 1);
    CHECK(device.at(i) == host[i]);
  }
}

TEST_CASE("the fingerprint tells plans apart") {
  using namespace plan_agreement;
  using ResNet = fp::models::ResNet18Cifar<10>;
  // The same network in another precision: Bf16 narrows outputs, which moves the workspace's regions.
  CHECK(fp::CudaPlanFingerprint<ResNet, fp::precision::Bf16>::value !=
        fp::CudaPlanFingerprint<ResNet, fp::precision::Tf32>::value);
  // Tf32 and Fp32 plan alike but are different precisions.
  CHECK(fp::CudaPlanFingerprint<ResNet, fp::precision::Fp32>::value !=
        fp::CudaPlanFingerprint<ResNet, fp::precision::Tf32>::value);
  // Every case differs from every other.
  constexpr auto all = host_fingerprints(std::make_index_sequence<case_count>{});
  for (std::size_t i = 0; i < all.size(); ++i)
    for (std::size_t j = i + 1; j < all.size(); ++j) {
      CAPTURE(i);
      CAPTURE(j);
      CHECK(all[i] != all[j]);
    }
}
