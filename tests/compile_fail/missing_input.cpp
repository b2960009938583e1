// A Sequential whose first layer is not Input<C,H,W>.
// expect: static assertion failed
// expect: the first layer must be Input<C, H, W>
// expect: fusedp::Sequential<fusedp::Conv2d<4, 3>, fusedp::ReLU>
#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/net/sequential.hpp>

using Net = fusedp::Sequential<fusedp::Conv2d<4, 3>, fusedp::ReLU>;
static_assert(Net::param_count > 0);

int main() {}
