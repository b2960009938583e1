// A layer of a block's projection shortcut that cannot take the block's input: reported with the
// block's index in the network (2) and the layer's in the projection (1, as its tensors are named,
// torchvision's "downsample.1"), the layer and both shapes (BatchNorm1d receives (8, 3, 3)), in the
// form of a top-level mismatch.
// expect: static assertion failed
// expect: a layer of a block's projection shortcut cannot take the shape it receives
// expect: shortcut_shape_mismatch<2, 1, fusedp::BatchNorm1d<[^>]*>, fusedp::Shape<72, 1, 1>, fusedp::Shape<8, 3, 3> ?>
#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/batch_norm.hpp>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/net/residual.hpp>
#include <fusedp/net/sequential.hpp>

using Net = fusedp::Sequential<
    fusedp::Input<3, 6, 6>, fusedp::Conv2d<4, 3, 1, 1>,
    fusedp::Residual<fusedp::Conv2d<8, 3, 2, 1>, fusedp::BatchNorm2d<>,
                     fusedp::Projection<fusedp::Conv2d<8, 1, 2, 0>, fusedp::BatchNorm1d<>>>,
    fusedp::ReLU>;
static_assert(Net::param_count > 0);

int main() {}
