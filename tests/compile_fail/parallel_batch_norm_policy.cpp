// A network with BatchNorm in Parallel without a batch_norm policy: the replicas would each keep the
// running statistics of their own shards. The message names both choices.
// expect: static assertion failed
// expect: the network holds BatchNorm running statistics
// expect: batch_norm::Sync
// expect: batch_norm::Broadcast
#include <fusedp/layers/batch_norm.hpp>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/flatten.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/layers/linear.hpp>
#include <fusedp/parallel/parallel.hpp>

using Net = fusedp::Sequential<fusedp::Input<1, 8, 8>, fusedp::Conv2d<4, 3>, fusedp::BatchNorm2d<>, fusedp::Flatten,
                               fusedp::Linear<10>>;

int main() {
  fusedp::Parallel<Net, fusedp::Host> dp{fusedp::replicas(2, 1)};
  (void)dp;
}
