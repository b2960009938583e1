// The seed networks, written once for the tests and benchmarks: LeNet of PyTorch's multi-GPU
// tutorial, the CNN of its CIFAR-10 tutorial, and the MLP of tiny-cuda-nn's benchmark (5 hidden layers
// of width W and an output layer of width W). The examples spell their networks out, for the reader.
#pragma once

#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/flatten.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/layers/linear.hpp>
#include <fusedp/layers/pooling.hpp>
#include <fusedp/net/sequential.hpp>

namespace seed_networks {

using LeNet = fusedp::Sequential<fusedp::Input<1, 28, 28>, fusedp::Conv2d<6, 5>, fusedp::ReLU, fusedp::MaxPool2d<2>,
                                 fusedp::Conv2d<16, 3>, fusedp::ReLU, fusedp::MaxPool2d<2>, fusedp::Flatten,
                                 fusedp::Linear<120>, fusedp::ReLU, fusedp::Linear<60>, fusedp::ReLU, fusedp::Linear<10>>;

using CifarCnn = fusedp::Sequential<fusedp::Input<3, 32, 32>, fusedp::Conv2d<64, 3, 1, 1>, fusedp::ReLU,
                                    fusedp::MaxPool2d<2>, fusedp::Conv2d<128, 3, 1, 1>, fusedp::ReLU,
                                    fusedp::MaxPool2d<2>, fusedp::Flatten, fusedp::Linear<1024>, fusedp::ReLU,
                                    fusedp::Linear<10>>;

template <int W>
using Mlp = fusedp::Sequential<fusedp::Input<W>, fusedp::Linear<W>, fusedp::ReLU, fusedp::Linear<W>, fusedp::ReLU,
                               fusedp::Linear<W>, fusedp::ReLU, fusedp::Linear<W>, fusedp::ReLU, fusedp::Linear<W>,
                               fusedp::ReLU, fusedp::Linear<W>>;

}  // namespace seed_networks
