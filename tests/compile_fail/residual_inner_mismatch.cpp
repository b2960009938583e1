// A layer inside a block that cannot take its input: reported with the block's index in the network
// (2) and the layer's in the block (1, as its tensors are named: "2.1.weight"), the layer and both
// shapes (BatchNorm1d receives (4, 6, 6)), in the form of a top-level mismatch.
// expect: static assertion failed
// expect: a layer inside a block cannot take the shape it receives
// expect: block_shape_mismatch<2, 1, fusedp::BatchNorm1d<[^>]*>, fusedp::Shape<144, 1, 1>, fusedp::Shape<4, 6, 6> ?>
#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/batch_norm.hpp>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/net/residual.hpp>
#include <fusedp/net/sequential.hpp>

using Net = fusedp::Sequential<
    fusedp::Input<3, 6, 6>, fusedp::Conv2d<4, 3, 1, 1>,
    fusedp::Residual<fusedp::Conv2d<4, 3, 1, 1>, fusedp::BatchNorm1d<>, fusedp::IdentityShortcut>, fusedp::ReLU>;
static_assert(Net::param_count > 0);

int main() {}
