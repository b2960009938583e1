// batch_norm::Sync and batch_norm::Broadcast together: one category, one choice.
// expect: static assertion failed
// expect: more than one batch_norm policy \(category batch_norm: Broadcast, Sync\)
#include <fusedp/layers/batch_norm.hpp>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/flatten.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/layers/linear.hpp>
#include <fusedp/parallel/parallel.hpp>

using Net = fusedp::Sequential<fusedp::Input<1, 8, 8>, fusedp::Conv2d<4, 3>, fusedp::BatchNorm2d<>, fusedp::Flatten,
                               fusedp::Linear<10>>;

int main() {
  fusedp::Parallel<Net, fusedp::Host, fusedp::batch_norm::Sync, fusedp::batch_norm::Broadcast> dp{
      fusedp::replicas(2, 1)};
  (void)dp;
}
