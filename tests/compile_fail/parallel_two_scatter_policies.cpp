// Two scatter policies: the message names the category.
// expect: static assertion failed
// expect: more than one scatter policy \(category scatter
#include <fusedp/exec/host.hpp>
#include <fusedp/parallel/policy.hpp>

using P = fusedp::parallel::Policy<fusedp::Host, fusedp::scatter::Even, fusedp::Overlap, fusedp::scatter::Sharded>;
static_assert(P::overlap);

int main() {}
