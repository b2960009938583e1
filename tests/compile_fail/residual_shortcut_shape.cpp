// A block whose body halves the plane (stride 2) with an identity shortcut: the add cannot take
// (4, 3, 3) and (4, 6, 6). The message names both shapes and says to use a Projection.
// expect: static assertion failed
// expect: the body's output and the shortcut's output differ in shape
// expect: residual_shape_mismatch<fusedp::Shape<4, 3, 3>, fusedp::Shape<4, 6, 6> ?>
#include <fusedp/layers/batch_norm.hpp>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/net/residual.hpp>
#include <fusedp/net/sequential.hpp>

using Net = fusedp::Sequential<fusedp::Input<4, 6, 6>,
                               fusedp::Residual<fusedp::Conv2d<4, 3, 2, 1>, fusedp::BatchNorm2d<>,
                                                fusedp::IdentityShortcut>>;
static_assert(Net::param_count > 0);

int main() {}
