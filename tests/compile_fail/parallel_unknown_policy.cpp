// A type that is no policy at all, given inside the reduce policy.
// expect: static assertion failed
// expect: a policy is not one of scatter
#include <fusedp/exec/host.hpp>
#include <fusedp/parallel/policy.hpp>

struct NotAPolicy {};
using P = fusedp::parallel::Policy<fusedp::Host, fusedp::reduce::AllReduce<NotAPolicy>>;
static_assert(!P::overlap);

int main() {}
