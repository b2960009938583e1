// The Cuda plans tests/plan_agreement/ compares between nvcc's front end (plan_agreement.cu, device
// code) and the host compiler (plan_agreement.cpp): the seed networks, ResNet-18, and networks with
// BatchNorm, residual blocks of both kinds of add and Dropout, in every precision.
#pragma once

#include <fusedp/layers/batch_norm.hpp>
#include <fusedp/layers/dropout.hpp>
#include <fusedp/layers/global_avg_pool.hpp>
#include <fusedp/models/resnet.hpp>
#include <fusedp/net/cuda_plan.hpp>
#include <fusedp/net/residual.hpp>

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <utility>

#include "../support/seed_networks.hpp"

namespace plan_agreement {

namespace fp = fusedp;

// A projection block and an identity block whose adds run in BatchNorm's pass, average pooling, GELU.
using BlockNet = fp::Sequential<fp::Input<3, 8, 8>, fp::Conv2d<8, 3, 1, 1>, fp::BatchNorm2d<>, fp::ReLU,
                                fp::Residual<fp::Conv2d<12, 3, 2, 1>, fp::BatchNorm2d<>, fp::ReLU, fp::Conv2d<12, 3, 1, 1>,
                                             fp::BatchNorm2d<>, fp::Projection<fp::Conv2d<12, 1, 2, 0>, fp::BatchNorm2d<>>>,
                                fp::ReLU,
                                fp::Residual<fp::Conv2d<12, 3, 1, 1>, fp::BatchNorm2d<>, fp::ReLU, fp::Conv2d<12, 3, 1, 1>,
                                             fp::BatchNorm2d<>, fp::IdentityShortcut>,
                                fp::ReLU, fp::AvgPool2d<2>, fp::Flatten, fp::Linear<6>, fp::GELU, fp::Linear<3>>;
// An identity block whose add is a pass of its own (the body ends in a conv).
using SeparateAddNet = fp::Sequential<fp::Input<4, 5, 5>, fp::Conv2d<4, 1>,
                                      fp::Residual<fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::Conv2d<4, 3, 1, 1>,
                                                   fp::IdentityShortcut>,
                                      fp::ReLU, fp::Flatten, fp::Linear<3>>;
// BatchNorm1d and Dropout between Linear layers, global average pooling.
using NormDropoutNet = fp::Sequential<fp::Input<3, 8, 8>, fp::Conv2d<8, 3, 1, 1>, fp::BatchNorm2d<>, fp::ReLU,
                                      fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<16>, fp::BatchNorm1d<>, fp::ReLU,
                                      fp::Dropout<0.25f>, fp::Linear<4>>;

template <class Net, class P>
struct Case {
  using fingerprint = fp::CudaPlanFingerprint<Net, P>;
};
template <class Net>
using Precisions = std::tuple<Case<Net, fp::precision::Tf32>, Case<Net, fp::precision::Bf16>,
                              Case<Net, fp::precision::Fp32>>;
using Cases = decltype(std::tuple_cat(Precisions<seed_networks::LeNet>{}, Precisions<seed_networks::CifarCnn>{},
                                      Precisions<seed_networks::Mlp<64>>{}, Precisions<fp::models::ResNet18Cifar<10>>{},
                                      Precisions<BlockNet>{}, Precisions<SeparateAddNet>{},
                                      Precisions<NormDropoutNet>{}));
inline constexpr std::size_t case_count = std::tuple_size_v<Cases>;
template <std::size_t I>
using fingerprint_of = typename std::tuple_element_t<I, Cases>::fingerprint;

}  // namespace plan_agreement
