#pragma once
// ResNet-18 in its CIFAR form (He et al. 2016, as the data-parallel benchmarks train it): a 3x3 stride-1
// stem without max-pooling, four stages of two basic blocks (64, 128, 256, 512 channels; the first
// block of stages 2-4 halves the plane with a strided conv and a projection shortcut), global average
// pooling and one Linear. The tensors carry torchvision's names (conv1.weight, bn1.running_mean,
// layer2.0.downsample.0.weight, fc.bias, ...), so torchvision's resnet18(num_classes=10) with its stem
// replaced by a 3x3 stride-1 conv and its max-pool by an identity loads fusedp's weights strictly, and
// fusedp loads its.
#include "fusedp/layers/activation.hpp"
#include "fusedp/layers/batch_norm.hpp"
#include "fusedp/layers/conv2d.hpp"
#include "fusedp/layers/flatten.hpp"
#include "fusedp/layers/global_avg_pool.hpp"
#include "fusedp/layers/input.hpp"
#include "fusedp/layers/linear.hpp"
#include "fusedp/layers/named.hpp"
#include "fusedp/net/residual.hpp"
#include "fusedp/net/sequential.hpp"

#include <type_traits>

namespace fusedp::models {

/// torchvision's module names (see layers/named.hpp for why they are arrays).
namespace names {
inline constexpr char conv1[] = "conv1";
inline constexpr char bn1[] = "bn1";
inline constexpr char conv2[] = "conv2";
inline constexpr char bn2[] = "bn2";
inline constexpr char downsample[] = "downsample";
inline constexpr char fc[] = "fc";
inline constexpr char layer1_0[] = "layer1.0";
inline constexpr char layer1_1[] = "layer1.1";
inline constexpr char layer2_0[] = "layer2.0";
inline constexpr char layer2_1[] = "layer2.1";
inline constexpr char layer3_0[] = "layer3.0";
inline constexpr char layer3_1[] = "layer3.1";
inline constexpr char layer4_0[] = "layer4.0";
inline constexpr char layer4_1[] = "layer4.1";
}  // namespace names

/// torchvision's BasicBlock: conv3x3(stride) - BN - ReLU - conv3x3 - BN, plus the shortcut (a 1x1
/// strided conv and BN, "downsample", when the shape changes). The ReLU after the add follows the block.
/// @tparam Out output channels
/// @tparam Stride stride of the first conv (2 halves the plane)
/// @tparam Project whether the shortcut is a projection (else the identity)
template <int Out, int Stride, bool Project>
using BasicBlock = Residual<
    Named<names::conv1, Conv2d<Out, 3, Stride, 1, no_bias>>, Named<names::bn1, BatchNorm2d<>>, ReLU,
    Named<names::conv2, Conv2d<Out, 3, 1, 1, no_bias>>, Named<names::bn2, BatchNorm2d<>>,
    std::conditional_t<Project,
                       Named<names::downsample, Projection<Conv2d<Out, 1, Stride, 0, no_bias>, BatchNorm2d<>>>,
                       IdentityShortcut>>;

/// ResNet-18 for 32x32 inputs (CIFAR-10): 11,173,962 parameters with 10 classes.
/// @tparam Classes outputs of the last Linear
template <int Classes = 10>
using ResNet18Cifar = Sequential<
    Input<3, 32, 32>,                                                                     //
    Named<names::conv1, Conv2d<64, 3, 1, 1, no_bias>>, Named<names::bn1, BatchNorm2d<>>, ReLU,     // stem
    Named<names::layer1_0, BasicBlock<64, 1, false>>, ReLU, Named<names::layer1_1, BasicBlock<64, 1, false>>, ReLU,
    Named<names::layer2_0, BasicBlock<128, 2, true>>, ReLU, Named<names::layer2_1, BasicBlock<128, 1, false>>, ReLU,
    Named<names::layer3_0, BasicBlock<256, 2, true>>, ReLU, Named<names::layer3_1, BasicBlock<256, 1, false>>, ReLU,
    Named<names::layer4_0, BasicBlock<512, 2, true>>, ReLU, Named<names::layer4_1, BasicBlock<512, 1, false>>, ReLU,
    GlobalAvgPool2d, Flatten, Named<names::fc, Linear<Classes>>>;

}  // namespace fusedp::models
