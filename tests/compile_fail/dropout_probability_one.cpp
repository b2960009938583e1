// Dropout<1.0f> would drop everything and divide by zero.
// expect: static assertion failed
// expect: Dropout<P>: P must be in .0, 1.
#include <fusedp/layers/dropout.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/net/sequential.hpp>

using Net = fusedp::Sequential<fusedp::Input<1, 8, 8>, fusedp::Dropout<1.0f>>;
static_assert(Net::param_count == 0);

int main() {}
