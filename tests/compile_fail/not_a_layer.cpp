// A type that is not a layer (int) as layer 2.
// expect: static assertion failed
// expect: every element after Input must be a layer
// expect: bind_checked<2, int, fusedp::Shape<1, 8, 8> ?>
#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/net/sequential.hpp>

using Net = fusedp::Sequential<fusedp::Input<1, 8, 8>, fusedp::ReLU, int>;
static_assert(Net::param_count == 0);

int main() {}
