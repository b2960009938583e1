#pragma once
// Owning host memory and non-owning tensor views.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"

#include <array>
#include <cstddef>
#include <cstring>
#include <new>
#include <span>
#include <utility>

namespace fusedp {

/// Owning, aligned, zero-initialized host array. Move-only; never reallocates behind the caller.
template <class T>
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(std::size_t n) : size_(n) {
    if (n == 0) return;
    data_ = static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{alignment_bytes}));
    std::memset(static_cast<void*>(data_), 0, n * sizeof(T));
  }
  HostBuffer(HostBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { release(); }

  [[nodiscard]] T* data() noexcept { return data_; }
  [[nodiscard]] const T* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::span<T> span() noexcept { return {data_, size_}; }
  [[nodiscard]] std::span<const T> span() const noexcept { return {data_, size_}; }
  T& operator[](std::size_t i) noexcept { return data_[i]; }
  const T& operator[](std::size_t i) const noexcept { return data_[i]; }

  /// Grows to at least `n` elements (contents are not kept); does nothing when already large enough.
  void reserve_discard(std::size_t n) {
    if (n > size_) *this = HostBuffer(n);
  }

 private:
  void release() noexcept {
    if (data_) ::operator delete(static_cast<void*>(data_), std::align_val_t{alignment_bytes});
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

/// Non-owning view of a dense row-major tensor: a pointer and its extents.
/// @tparam T element type (const for a read-only view)
/// @tparam Rank number of dimensions
template <class T, std::size_t Rank>
class TensorView {
 public:
  constexpr TensorView() = default;
  constexpr TensorView(T* data, std::array<std::size_t, Rank> extents) : data_(data), extents_(extents) {}

  [[nodiscard]] constexpr T* data() const noexcept { return data_; }
  [[nodiscard]] constexpr std::size_t extent(std::size_t d) const noexcept { return extents_[d]; }
  [[nodiscard]] constexpr const std::array<std::size_t, Rank>& extents() const noexcept { return extents_; }
  [[nodiscard]] constexpr std::size_t size() const noexcept {
    std::size_t n = 1;
    for (auto e : extents_) n *= e;
    return n;
  }
  [[nodiscard]] constexpr std::span<T> span() const noexcept { return {data_, size()}; }

  template <class... I>
    requires(sizeof...(I) == Rank)
  constexpr T& operator()(I... index) const noexcept {
    const std::size_t idx[] = {static_cast<std::size_t>(index)...};
    std::size_t off = 0;
    for (std::size_t d = 0; d < Rank; ++d) off = off * extents_[d] + idx[d];
    return data_[off];
  }
  /// The sub-tensor at index `i` of the first dimension (e.g. one row of a batch).
  [[nodiscard]] constexpr auto operator[](std::size_t i) const noexcept
    requires(Rank > 1)
  {
    std::array<std::size_t, Rank - 1> sub{};
    for (std::size_t d = 1; d < Rank; ++d) sub[d - 1] = extents_[d];
    return TensorView<T, Rank - 1>(data_ + i * (size() / extents_[0]), sub);
  }

 private:
  T* data_ = nullptr;
  std::array<std::size_t, Rank> extents_{};
};

}  // namespace fusedp
