// Bucket given twice, once inside the reduce policy and once beside it.
// expect: static assertion failed
// expect: more than one Bucket<bytes> \(category bucket\)
#include <fusedp/exec/host.hpp>
#include <fusedp/parallel/policy.hpp>

using P = fusedp::parallel::Policy<fusedp::Host, fusedp::reduce::AllReduce<fusedp::Bucket<1024>>, fusedp::Bucket<2048>>;
static_assert(P::bucketed);

int main() {}
