// Linear directly after Conv2d, without Flatten: layer 2 (Linear<10>) needs a flat input of 3456
// features but receives the (6, 24, 24) feature maps. The message names the index and both shapes.
// expect: static assertion failed
// expect: a layer cannot take the shape it receives
// expect: shape_mismatch<2, fusedp::Linear<10>, fusedp::Shape<3456, 1, 1>, fusedp::Shape<6, 24, 24> ?>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/layers/linear.hpp>
#include <fusedp/net/sequential.hpp>

using Net = fusedp::Sequential<fusedp::Input<1, 28, 28>, fusedp::Conv2d<6, 5>, fusedp::Linear<10>>;
static_assert(Net::output_shape::size == 10);

int main() {}
