#pragma once
// Files fusedp writes carry a CRC-32 (train/safetensors.hpp), so nearly every mutation of a valid
// file stops at "checksum mismatch" and the fuzzer never sees the checks behind it. The safetensors
// and checkpoint targets therefore let a flag in the input repair the checksum after mutation, the
// way PNG fuzzers repair chunk CRCs; with the flag clear the damaged checksum is what is tested.
#include "fusedp/train/safetensors.hpp"

#include "fuzz_common.hpp"

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace fusedp_fuzz {

/// The header of safetensors bytes `b`, when its length field fits the file.
inline std::optional<std::span<const std::uint8_t>> header_of(const Bytes& b) {
  if (b.size() < 8) return std::nullopt;
  const std::uint64_t n = fusedp::train::detail::read_u64_le(b.data());
  if (n > b.size() - 8) return std::nullopt;
  return std::span<const std::uint8_t>(b.data() + 8, std::size_t(n));
}

/// Sets the 8 characters after `"key":"` in the header of `b` (when the key occurs once, with room).
inline bool set_meta_digits(Bytes& b, std::string_view key, const std::string& eight) {
  const auto header = header_of(b);
  if (!header) return false;
  const std::string needle = "\"" + std::string(key) + "\":\"";
  const std::string_view text(reinterpret_cast<const char*>(header->data()), header->size());
  const std::size_t at = text.find(needle);
  if (at == std::string_view::npos || text.find(needle, at + 1) != std::string_view::npos) return false;
  if (at + needle.size() + 8 > text.size()) return false;
  std::memcpy(b.data() + 8 + at + needle.size(), eight.data(), 8);
  return true;
}

/// Rewrites fusedp's checksum of `b` to match its contents; returns it, or nothing when `b` has no
/// place for one.
inline std::optional<std::uint32_t> fix_checksum(Bytes& b) {
  namespace d = fusedp::train::detail;
  const auto header = header_of(b);
  if (!header) return std::nullopt;
  const auto digits = d::checksum_digits_at(*header, 8);
  if (!digits) return std::nullopt;
  const std::uint32_t crc = d::crc32_with_hole(b, *digits, 8);
  const std::string hex = d::hex32(crc);
  std::memcpy(b.data() + *digits, hex.data(), 8);
  return crc;
}

}  // namespace fusedp_fuzz
