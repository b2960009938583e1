// A layer inside a block that cannot take its input: the block's own Sequential reports it with the
// layer's index inside the block (BatchNorm1d, 2nd of the body, receives (4, 6, 6)); the compiler's
// trace names the outer network's index of the block (bind_checked<2, ...Residual...).
// expect: static assertion failed
// expect: a layer cannot take the shape it receives
// expect: shape_mismatch<2, fusedp::BatchNorm1d<[^>]*>, fusedp::Shape<144, 1, 1>, fusedp::Shape<4, 6, 6> ?>
// expect: bind_checked<2, fusedp::Residual<
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
