// What most tests and benchmarks use of fusedp: the umbrella header without parallel/, data/ and
// train/ (checkpoints bring nlohmann-json, which costs about 3.5 s of g++ and 13 s of nvcc per
// translation unit, measured on the 2-core CI machine). Each file includes the rest it needs by name.
#pragma once

#include <fusedp/core/buffer.hpp>
#include <fusedp/core/config.hpp>
#include <fusedp/core/error.hpp>
#include <fusedp/core/rng.hpp>
#include <fusedp/core/shape.hpp>
#include <fusedp/exec/cuda.hpp>
#include <fusedp/exec/host.hpp>
#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/batch_norm.hpp>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/dropout.hpp>
#include <fusedp/layers/flatten.hpp>
#include <fusedp/layers/global_avg_pool.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/layers/linear.hpp>
#include <fusedp/layers/named.hpp>
#include <fusedp/layers/pooling.hpp>
#include <fusedp/loss/mse.hpp>
#include <fusedp/loss/softmax_cross_entropy.hpp>
#include <fusedp/models/resnet.hpp>
#include <fusedp/net/model.hpp>
#include <fusedp/net/residual.hpp>
#include <fusedp/net/sequential.hpp>
#include <fusedp/optim/adam.hpp>
#include <fusedp/optim/guard.hpp>
#include <fusedp/optim/schedule.hpp>
#include <fusedp/optim/sgd.hpp>
