// tests include/fusedp/net/sequential.hpp: shape inference, the flat parameter layout, the fusion plan
// and the workspace plan, as compile-time facts (static_assert) and checked again at run time.
#include <doctest/doctest.h>

#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/dropout.hpp>
#include <fusedp/layers/flatten.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/layers/linear.hpp>
#include <fusedp/layers/pooling.hpp>
#include <fusedp/net/sequential.hpp>

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>
#include <vector>
#include "../support/seed_networks.hpp"

namespace fp = fusedp;
namespace k = fusedp::kernels;

using seed_networks::LeNet;
using seed_networks::CifarCnn;

static_assert(fp::Network<LeNet> && fp::Network<CifarCnn>);
static_assert(!fp::Network<int> && !fp::Network<fp::Linear<3>>);

// --- shapes --------------------------------------------------------------------------------------
namespace {
template <class Net, std::size_t I>
using layer_out = typename fp::detail::type_at<I, typename Net::bound_layers>::type::out;
template <class Net, std::size_t I>
using layer_in = typename fp::detail::type_at<I, typename Net::bound_layers>::type::in;
}  // namespace

static_assert(std::is_same_v<LeNet::input_shape, fp::Shape<1, 28, 28>>);
static_assert(std::is_same_v<LeNet::output_shape, fp::Shape<10, 1, 1>>);
static_assert(LeNet::output_shape::size == 10);
static_assert(LeNet::layer_count == 13);
static_assert(LeNet::bound_layers::size == 12);  // Input is not a bound layer
static_assert(std::is_same_v<layer_out<LeNet, 0>, fp::Shape<6, 24, 24>>);    // Conv2d<6,5>
static_assert(std::is_same_v<layer_out<LeNet, 1>, fp::Shape<6, 24, 24>>);    // ReLU
static_assert(std::is_same_v<layer_out<LeNet, 2>, fp::Shape<6, 12, 12>>);    // MaxPool2d<2>
static_assert(std::is_same_v<layer_out<LeNet, 3>, fp::Shape<16, 10, 10>>);   // Conv2d<16,3>
static_assert(std::is_same_v<layer_out<LeNet, 5>, fp::Shape<16, 5, 5>>);     // MaxPool2d<2>
static_assert(std::is_same_v<layer_out<LeNet, 6>, fp::Shape<400, 1, 1>>);    // Flatten
static_assert(std::is_same_v<layer_in<LeNet, 7>, fp::Shape<400, 1, 1>>);     // Linear<120>
static_assert(std::is_same_v<layer_out<LeNet, 7>, fp::Shape<120, 1, 1>>);
static_assert(std::is_same_v<layer_out<LeNet, 11>, fp::Shape<10, 1, 1>>);
static_assert(fp::detail::type_at<7, LeNet::bound_layers>::type::index == 8);  // indices count Input as 0

static_assert(std::is_same_v<CifarCnn::output_shape, fp::Shape<10, 1, 1>>);
static_assert(std::is_same_v<layer_out<CifarCnn, 0>, fp::Shape<64, 32, 32>>);  // 'same' padding
static_assert(std::is_same_v<layer_out<CifarCnn, 5>, fp::Shape<128, 8, 8>>);
static_assert(std::is_same_v<layer_out<CifarCnn, 6>, fp::Shape<8192, 1, 1>>);

// Odd geometries: floor mode, stride and padding.
using Odd = fp::Sequential<fp::Input<3, 7, 9>, fp::Conv2d<4, 3, 2, 1>, fp::MaxPool2d<3, 2>, fp::AvgPool2d<1>,
                           fp::Flatten, fp::Dropout<0.25f>, fp::Linear<5>, fp::GELU>;
static_assert(std::is_same_v<layer_out<Odd, 0>, fp::Shape<4, 4, 5>>);  // (7+2-3)/2+1, (9+2-3)/2+1
static_assert(std::is_same_v<layer_out<Odd, 1>, fp::Shape<4, 1, 2>>);  // (4-3)/2+1, (5-3)/2+1
static_assert(std::is_same_v<layer_out<Odd, 2>, fp::Shape<4, 1, 2>>);
static_assert(std::is_same_v<layer_out<Odd, 3>, fp::Shape<8, 1, 1>>);
static_assert(std::is_same_v<Odd::output_shape, fp::Shape<5, 1, 1>>);

// --- parameter counts ----------------------------------------------------------------------------
// LeNet: 6*1*5*5+6 + 16*6*3*3+16 + 400*120+120 + 120*60+60 + 60*10+10
static_assert(LeNet::param_count == 57'026);
static_assert(LeNet::param_count == (150 + 6) + (864 + 16) + (48000 + 120) + (7200 + 60) + (600 + 10));
// CIFAR CNN: 64*3*3*3+64 + 128*64*3*3+128 + 8192*1024+1024 + 1024*10+10
static_assert(CifarCnn::param_count == 1792 + 73856 + 8389632 + 10250);
static_assert(CifarCnn::param_count == 8'475'530);
static_assert(LeNet::param_tensor_count == 10 && CifarCnn::param_tensor_count == 8);
static_assert(Odd::param_tensor_count == 4);

namespace {

template <class Net>
std::size_t sum_sizes() {
  std::size_t n = 0;
  for (const auto& t : Net::param_layout) n += t.size;
  return n;
}

/// The layout invariants every network must satisfy.
template <class Net>
void check_layout() {
  const auto& layout = Net::param_layout;
  REQUIRE(layout.size() == Net::param_tensor_count);
  CHECK(sum_sizes<Net>() == Net::param_count);
  std::size_t expected_offset = 0;
  for (std::size_t i = 0; i < layout.size(); ++i) {
    CAPTURE(i);
    const fp::ParamTensor& t = layout[i];
    CHECK(t.offset % fp::align_elements_count == 0);
    // Packed in order, each tensor starting at the next aligned offset after the previous one.
    CHECK(t.offset == expected_offset);
    expected_offset = t.offset + fp::align_elements(t.size);
    // Offsets in elements are aligned for float and for double alike (64 bytes = 16 floats).
    CHECK((t.offset * sizeof(float)) % fp::alignment_bytes == 0);
    // The dims multiply to the size.
    std::size_t product = 1;
    for (int d = 0; d < t.rank; ++d) product *= std::size_t(t.dims[std::size_t(d)]);
    CHECK(product == t.size);
    for (int d = t.rank; d < 4; ++d) CHECK(t.dims[std::size_t(d)] == 0);
    CHECK(t.fan_in > 0);
    if (i > 0) CHECK(layout[i - 1].layer <= t.layer);
    // PyTorch order: a layer's weight, then its bias.
    if (t.role == fp::ParamRole::bias) {
      REQUIRE(i > 0);
      CHECK(layout[i - 1].role == fp::ParamRole::weight);
      CHECK(layout[i - 1].layer == t.layer);
      CHECK(layout[i - 1].fan_in == t.fan_in);  // PyTorch draws the bias with the weight's fan_in
      CHECK(t.rank == 1);
      CHECK(std::size_t(t.dims[0]) == t.size);
      CHECK(layout[i - 1].dims[0] == t.dims[0]);  // out features / channels
    }
  }
  CHECK(Net::param_storage == expected_offset);
  CHECK(Net::param_storage >= Net::param_count);
  CHECK(Net::param_storage - Net::param_count <= Net::param_tensor_count * (fp::align_elements_count - 1));
}

/// The workspace plan: every stage's output and saved tensor has its own aligned region inside
/// activation_elements, and no two regions overlap.
template <class Net>
void check_workspace() {
  std::vector<std::pair<std::size_t, std::size_t>> regions;  // [begin, end)
  std::size_t max_out = fp::align_elements(Net::input_shape::size);
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          using S = typename Net::template stage<I>;
          constexpr fp::StagePlan p = Net::stage_plan[I];
          CAPTURE(I);
          CHECK(p.aliases_input == (S::kind == fp::LayerKind::reshape));
          max_out = std::max(max_out, fp::align_elements(S::out::size));
          if (!p.aliases_input) {
            CHECK(p.out_offset % fp::align_elements_count == 0);
            regions.emplace_back(p.out_offset, p.out_offset + S::out::size);
          } else {
            CHECK(S::in::size == S::out::size);
          }
          CHECK(p.saves_z == (S::epilogue::saves_input && S::kind != fp::LayerKind::pointwise));
          if (p.saves_z) {
            CHECK(p.z_offset % fp::align_elements_count == 0);
            regions.emplace_back(p.z_offset, p.z_offset + S::out::size);
          }
          // A stage with parameters points at its own layer's weight and bias.
          if constexpr (S::has_params) {
            bool found_w = false, found_b = false;
            for (const auto& t : Net::param_layout) {
              if (t.layer != S::first) continue;
              if (t.role == fp::ParamRole::weight) found_w = p.weight == t.offset;
              if (t.role == fp::ParamRole::bias) found_b = p.bias == t.offset;
            }
            CHECK(found_w);
            CHECK(found_b);
          }
        }(),
        ...);
  }(std::make_index_sequence<Net::stage_count>{});
  std::sort(regions.begin(), regions.end());
  for (std::size_t i = 0; i < regions.size(); ++i) {
    CAPTURE(i);
    CHECK(regions[i].first < regions[i].second);
    CHECK(regions[i].second <= Net::activation_elements);
    if (i > 0) CHECK(regions[i - 1].second <= regions[i].first);
  }
  CHECK(Net::gradient_elements == max_out);
  CHECK(Net::workspace_elements_per_sample == Net::activation_elements + 2 * Net::gradient_elements);
}

/// The stages cover every layer after Input exactly once, in order.
template <class Net>
void check_stage_cover() {
  std::size_t next = 1;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          CAPTURE(I);
          CHECK(Net::template stage<I>::first == next);
          CHECK(Net::template stage<I>::last >= next);
          next = Net::template stage<I>::last + 1;
        }(),
        ...);
  }(std::make_index_sequence<Net::stage_count>{});
  CHECK(next == Net::layer_count);
}

}  // namespace

TEST_CASE("LeNet: parameter layout") {
  check_layout<LeNet>();
  const auto& l = LeNet::param_layout;
  const std::array<std::size_t, 10> layers{1, 1, 4, 4, 8, 8, 10, 10, 12, 12};
  const std::array<std::size_t, 10> sizes{150, 6, 864, 16, 48000, 120, 7200, 60, 600, 10};
  const std::array<std::size_t, 10> fan_in{25, 25, 54, 54, 400, 400, 120, 120, 60, 60};
  const std::array<int, 10> rank{4, 1, 4, 1, 2, 1, 2, 1, 2, 1};
  // 16 floats per 64 bytes: 150 -> 160, 6 -> 16, 864 stays, 16 stays, 48000 stays, 120 -> 128, ...
  const std::array<std::size_t, 10> offsets{0, 160, 176, 1040, 1056, 49056, 49184, 56384, 56448, 57056};
  for (std::size_t i = 0; i < 10; ++i) {
    CAPTURE(i);
    CHECK(l[i].layer == layers[i]);
    CHECK(l[i].size == sizes[i]);
    CHECK(l[i].fan_in == fan_in[i]);
    CHECK(l[i].rank == rank[i]);
    CHECK(l[i].offset == offsets[i]);
    CHECK(l[i].role == (i % 2 == 0 ? fp::ParamRole::weight : fp::ParamRole::bias));
  }
  CHECK(l[0].dims == std::array<int, 4>{6, 1, 5, 5});
  CHECK(l[1].dims == std::array<int, 4>{6, 0, 0, 0});
  CHECK(l[2].dims == std::array<int, 4>{16, 6, 3, 3});
  CHECK(l[4].dims == std::array<int, 4>{120, 400, 0, 0});
  CHECK(l[6].dims == std::array<int, 4>{60, 120, 0, 0});
  CHECK(l[8].dims == std::array<int, 4>{10, 60, 0, 0});
  CHECK(LeNet::param_storage == 57072);
}

TEST_CASE("CIFAR CNN: parameter layout") {
  check_layout<CifarCnn>();
  const auto& l = CifarCnn::param_layout;
  CHECK(l[0].dims == std::array<int, 4>{64, 3, 3, 3});
  CHECK(l[0].fan_in == 27);
  CHECK(l[2].dims == std::array<int, 4>{128, 64, 3, 3});
  CHECK(l[2].fan_in == 576);
  CHECK(l[4].dims == std::array<int, 4>{1024, 8192, 0, 0});
  CHECK(l[4].fan_in == 8192);
  CHECK(l[6].dims == std::array<int, 4>{10, 1024, 0, 0});
  CHECK(l[7].layer == 10);
}

TEST_CASE("layouts of networks with layers without parameters, and with none at all") {
  check_layout<Odd>();
  CHECK(Odd::param_layout[0].layer == 1);
  CHECK(Odd::param_layout[2].layer == 6);  // Linear after MaxPool, AvgPool, Flatten, Dropout
  CHECK(Odd::param_layout[2].fan_in == 8);
  using Empty = fp::Sequential<fp::Input<2, 4, 4>, fp::MaxPool2d<2>, fp::ReLU, fp::Flatten>;
  static_assert(Empty::param_count == 0 && Empty::param_storage == 0 && Empty::param_tensor_count == 0);
  static_assert(std::is_same_v<Empty::output_shape, fp::Shape<8, 1, 1>>);
  check_layout<Empty>();
  check_workspace<Empty>();
  check_stage_cover<Empty>();
}

TEST_CASE("LeNet: fusion plan") {
  static_assert(LeNet::stage_count == 8);
  using S0 = LeNet::stage<0>;
  static_assert(S0::first == 1 && S0::last == 2 && S0::kind == fp::LayerKind::anchor);
  static_assert(std::is_same_v<S0::layer, fp::Conv2d<6, 5>>);
  static_assert(std::is_same_v<S0::epilogue, k::Epilogue<k::Relu>>);
  static_assert(!S0::epilogue::saves_input && S0::has_params);
  using S1 = LeNet::stage<1>;
  static_assert(S1::first == 3 && S1::last == 3 && std::is_same_v<S1::layer, fp::MaxPool2d<2>>);
  static_assert(S1::epilogue::empty && !S1::has_params);
  static_assert(LeNet::stage<2>::first == 4 && LeNet::stage<2>::last == 5);
  static_assert(LeNet::stage<3>::first == 6 && LeNet::stage<3>::last == 6);
  using S4 = LeNet::stage<4>;
  static_assert(S4::first == 7 && S4::last == 7 && S4::kind == fp::LayerKind::reshape);
  static_assert(LeNet::stage<5>::first == 8 && LeNet::stage<5>::last == 9);
  static_assert(std::is_same_v<LeNet::stage<5>::in, fp::Shape<400, 1, 1>>);
  static_assert(LeNet::stage<6>::first == 10 && LeNet::stage<6>::last == 11);
  using S7 = LeNet::stage<7>;
  static_assert(S7::first == 12 && S7::last == 12 && S7::epilogue::empty);
  static_assert(std::is_same_v<S7::out, fp::Shape<10, 1, 1>>);
  check_stage_cover<LeNet>();
  for (const auto& p : LeNet::stage_plan) CHECK_FALSE(p.saves_z);  // ReLU derives from its output
  CHECK(LeNet::stage_plan[4].aliases_input);
}

TEST_CASE("fusion plan: chains, saved inputs, stand-alone activation stages, Dropout") {
  using Net = fp::Sequential<fp::Input<3, 8, 8>, fp::Tanh, fp::Conv2d<4, 3>, fp::ReLU, fp::Tanh,
                             fp::MaxPool2d<2>, fp::GELU, fp::Flatten, fp::Sigmoid, fp::Dropout<0.5f>, fp::ReLU,
                             fp::Linear<5>, fp::LeakyReLU<>, fp::Linear<3>, fp::GELU>;
  static_assert(Net::stage_count == 9);
  // 0: Tanh alone at the start: a pointwise stage, which keeps its input and saves nothing.
  static_assert(Net::stage<0>::kind == fp::LayerKind::pointwise && Net::stage<0>::first == 1 &&
                Net::stage<0>::last == 1);
  static_assert(std::is_same_v<Net::stage<0>::epilogue, k::Epilogue<k::Tanh>>);
  // 1: Conv2d + ReLU + Tanh: a chain, so the pre-activation is saved.
  static_assert(Net::stage<1>::first == 2 && Net::stage<1>::last == 4);
  static_assert(std::is_same_v<Net::stage<1>::epilogue, k::Epilogue<k::Relu, k::Tanh>>);
  static_assert(Net::stage<1>::epilogue::saves_input);
  // 2: MaxPool + GELU: GELU needs its input.
  static_assert(Net::stage<2>::first == 5 && Net::stage<2>::last == 6);
  static_assert(std::is_same_v<Net::stage<2>::epilogue, k::Epilogue<k::Gelu>>);
  // 3: Flatten; 4: Sigmoid alone; 5: Dropout (takes no epilogue); 6: ReLU alone.
  static_assert(Net::stage<3>::kind == fp::LayerKind::reshape && Net::stage<3>::first == 7);
  static_assert(Net::stage<4>::kind == fp::LayerKind::pointwise && Net::stage<4>::first == 8);
  static_assert(Net::stage<5>::kind == fp::LayerKind::anchor && Net::stage<5>::first == 9 &&
                Net::stage<5>::last == 9 && Net::stage<5>::epilogue::empty);
  static_assert(Net::stage<6>::kind == fp::LayerKind::pointwise && Net::stage<6>::first == 10);
  // 7: Linear + LeakyReLU (positive slope: derived from the output); 8: Linear + GELU.
  static_assert(Net::stage<7>::first == 11 && Net::stage<7>::last == 12 && !Net::stage<7>::epilogue::saves_input);
  static_assert(Net::stage<8>::first == 13 && Net::stage<8>::last == 14 && Net::stage<8>::epilogue::saves_input);

  constexpr auto& plan = Net::stage_plan;
  static_assert(!plan[0].saves_z && plan[1].saves_z && plan[2].saves_z && !plan[4].saves_z && !plan[5].saves_z &&
                !plan[6].saves_z && !plan[7].saves_z && plan[8].saves_z);
  static_assert(plan[3].aliases_input && !plan[2].aliases_input);
  check_stage_cover<Net>();
  check_workspace<Net>();
  check_layout<Net>();
}

TEST_CASE("epilogue saves_input rules") {
  static_assert(k::Epilogue<>::empty && !k::Epilogue<>::saves_input);
  static_assert(!k::Epilogue<k::Relu>::saves_input && !k::Epilogue<k::Tanh>::saves_input &&
                !k::Epilogue<k::Sigmoid>::saves_input && !k::Epilogue<k::LeakyRelu<0.01f>>::saves_input);
  static_assert(k::Epilogue<k::Gelu>::saves_input && k::Epilogue<k::LeakyRelu<-1.0f>>::saves_input);
  static_assert(k::Epilogue<k::Relu, k::Relu>::saves_input);  // any chain of two
  CHECK(k::Epilogue<k::Relu, k::Tanh>::apply(-1.0) == 0.0);
  CHECK(k::Epilogue<k::Relu, k::Tanh>::apply(0.5) == doctest::Approx(std::tanh(0.5)));
}

TEST_CASE("workspace plan: LeNet, CIFAR CNN") {
  check_workspace<LeNet>();
  check_workspace<CifarCnn>();
  check_workspace<Odd>();
  check_stage_cover<CifarCnn>();
  check_stage_cover<Odd>();
  // LeNet stage outputs per sample: 3456, 864, 1600, 400, (Flatten aliases), 120, 60, 10 -> aligned
  // 3456 + 864 + 1600 + 400 + 128 + 64 + 16; nothing saved.
  CHECK(LeNet::activation_elements == 6528);
  CHECK(LeNet::gradient_elements == 3456);
  // Host scratch: the largest of the convs' per-thread scratch as kernels/host/conv2d.hpp sizes it
  // (packed panels, bordered input, private weight and bias gradients).
  CHECK(LeNet::host_scratch_elements == 45872);
  CHECK(CifarCnn::gradient_elements == 64 * 32 * 32);
}
