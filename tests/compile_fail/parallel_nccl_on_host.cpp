// NCCL cannot move Host memory: the message names the category and what to use instead.
// expect: static assertion failed
// expect: comm::Nccl needs the Cuda space \(category comm\)
#include <fusedp/exec/host.hpp>
#include <fusedp/parallel/policy.hpp>

using P = fusedp::parallel::Policy<fusedp::Host, fusedp::comm::Nccl>;
static_assert(!P::overlap);

int main() {}
