// The second Conv2d (layer 3) has a 5x5 kernel; after the first conv the maps are (4, 6, 4): tall
// enough, one column too narrow. The nearest acceptable input is (4, 6, 5).
// expect: static assertion failed
// expect: shape_mismatch<3, fusedp::Conv2d<2, 5>, fusedp::Shape<4, 6, 5>, fusedp::Shape<4, 6, 4> ?>
#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/net/sequential.hpp>

using Net = fusedp::Sequential<fusedp::Input<3, 8, 6>, fusedp::Conv2d<4, 3>, fusedp::ReLU, fusedp::Conv2d<2, 5>>;
static_assert(Net::param_count > 0);

int main() {}
