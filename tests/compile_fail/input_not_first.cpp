// Input<C,H,W> as layer 2: only the first layer may be an Input. The message names the index.
// expect: static assertion failed
// expect: Input<C,H,W> may only be the first layer
// expect: bind_checked<2, fusedp::Input<4, 6, 6>, fusedp::Shape<4, 6, 6> ?>
#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/net/sequential.hpp>

using Net = fusedp::Sequential<fusedp::Input<1, 8, 8>, fusedp::Conv2d<4, 3>, fusedp::Input<4, 6, 6>, fusedp::ReLU>;
static_assert(Net::param_count > 0);

int main() {}
