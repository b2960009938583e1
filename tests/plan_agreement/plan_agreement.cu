// Compiled to PTX alone (device code: nvcc's front end evaluates the plans): kernel I stores the
// fingerprint of case I of networks.hpp, which plan_agreement.cpp reads back from the PTX text.
#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "networks.hpp"

template <std::size_t I>
__global__ void plan_fingerprint_case(std::uint64_t* out) {
  *out = plan_agreement::fingerprint_of<I>::value;
}

// Taking every kernel's address instantiates it in the device code.
template <std::size_t... I>
auto every_case(std::index_sequence<I...>) {
  return std::array<void (*)(std::uint64_t*), sizeof...(I)>{&plan_fingerprint_case<I>...};
}
auto every_case_kernel = every_case(std::make_index_sequence<plan_agreement::case_count>{});
