// A 7x7 kernel with padding 1 over a 4x4 input (layer 1): the padded input is 6x6 < 7x7; the nearest
// acceptable input is (3, 5, 5).
// expect: static assertion failed
// expect: shape_mismatch<1, fusedp::Conv2d<8, 7, 1, 1>, fusedp::Shape<3, 5, 5>, fusedp::Shape<3, 4, 4> ?>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/net/sequential.hpp>

using Net = fusedp::Sequential<fusedp::Input<3, 4, 4>, fusedp::Conv2d<8, 7, 1, 1>>;
static_assert(Net::param_count > 0);

int main() {}
