// A 5x5 kernel over a 4x4 input (layer 1): it needs at least (3, 5, 5) and receives (3, 4, 4).
// expect: static assertion failed
// expect: a layer cannot take the shape it receives
// expect: shape_mismatch<1, fusedp::Conv2d<8, 5>, fusedp::Shape<3, 5, 5>, fusedp::Shape<3, 4, 4> ?>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/net/sequential.hpp>

using Net = fusedp::Sequential<fusedp::Input<3, 4, 4>, fusedp::Conv2d<8, 5>>;
static_assert(Net::param_count > 0);

int main() {}
