// MaxPool2d<4> (layer 4) over (4, 3, 3) maps: the window needs at least (4, 4, 4).
// expect: static assertion failed
// expect: a layer cannot take the shape it receives
// expect: shape_mismatch<4, fusedp::MaxPool2d<4>, fusedp::Shape<4, 4, 4>, fusedp::Shape<4, 3, 3> ?>
#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/flatten.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/layers/linear.hpp>
#include <fusedp/layers/pooling.hpp>
#include <fusedp/net/sequential.hpp>

using Net = fusedp::Sequential<fusedp::Input<2, 9, 9>, fusedp::Conv2d<4, 3>, fusedp::MaxPool2d<2>, fusedp::ReLU,
                               fusedp::MaxPool2d<4>, fusedp::Flatten, fusedp::Linear<3>>;
static_assert(Net::param_count > 0);

int main() {}
