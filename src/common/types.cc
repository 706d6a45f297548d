// types.cc — dtype, tier and optimizer names; byte sizes with units.
#include "emsa/types.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace emsa {
namespace {

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

}  // namespace

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
      return 2;
    case DType::kFloat16:
      return 2;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
  }
  return "unknown";
}

Result<DType> ParseDType(std::string_view name) {
  std::string s = Lower(Trim(name));
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  if (s == "float32" || s == "fp32" || s == "float") return DType::kFloat32;
  if (s == "bfloat16" || s == "bf16") return DType::kBFloat16;
  if (s == "float16" || s == "fp16" || s == "half") return DType::kFloat16;
  return Status::Unsupported("dtype '" + std::string(name) +
                             "' is not supported; use float32, bfloat16 or float16 "
                             "(float64 and complex parameters must be cast first)");
}

const char* TierName(Tier tier) {
  switch (tier) {
    case Tier::kL0:
      return "L0";
    case Tier::kL1:
      return "L1";
    case Tier::kL2:
      return "L2";
  }
  return "unknown";
}

Result<Tier> ParseTier(std::string_view name) {
  std::string s = Lower(Trim(name));
  if (s == "l0") return Tier::kL0;
  if (s == "l1") return Tier::kL1;
  if (s == "l2") return Tier::kL2;
  return Status::InvalidArgument("tier '" + std::string(name) + "' is not one of L0, L1, L2");
}

const char* OptimizerName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kLion:
      return "lion";
  }
  return "unknown";
}

Result<OptimizerKind> ParseOptimizer(std::string_view name) {
  std::string s = Lower(Trim(name));
  if (s == "adamw") return OptimizerKind::kAdamW;
  if (s == "adam") return OptimizerKind::kAdam;
  if (s == "lion") return OptimizerKind::kLion;
  return Status::InvalidArgument("optimizer '" + std::string(name) +
                                 "' is not supported; use adamw, adam or lion");
}

int StateCount(OptimizerKind kind) { return kind == OptimizerKind::kLion ? 1 : 2; }

Result<uint64_t> ParseBytes(std::string_view text) {
  std::string_view s = Trim(text);
  if (s.empty()) return Status::InvalidArgument("empty size; write e.g. 24GiB, 512MiB or 1000000");
  std::string buf(s);
  const char* begin = buf.c_str();
  char* end = nullptr;
  double value = std::strtod(begin, &end);
  if (end == begin) {
    return Status::InvalidArgument("size '" + buf +
                                   "' does not start with a number; write e.g. 24GiB");
  }
  std::string unit = Lower(Trim(std::string_view(end)));
  double mult = 0;
  if (unit.empty() || unit == "b")
    mult = 1;
  else if (unit == "kib" || unit == "k")
    mult = 1024.0;
  else if (unit == "mib" || unit == "m")
    mult = 1024.0 * 1024;
  else if (unit == "gib" || unit == "g")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "tib" || unit == "t")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb")
    mult = 1e3;
  else if (unit == "mb")
    mult = 1e6;
  else if (unit == "gb")
    mult = 1e9;
  else if (unit == "tb")
    mult = 1e12;
  else {
    return Status::InvalidArgument("size '" + buf + "' has unknown unit '" + unit +
                                   "'; use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)");
  }
  if (!std::isfinite(value) || value < 0) {
    return Status::InvalidArgument("size '" + buf + "' must be a non-negative finite number");
  }
  double bytes = value * mult;
  constexpr double kMax = 1125899906842624.0;  // 1 PiB: no single machine has more
  if (bytes > kMax) {
    return Status::InvalidArgument("size '" + buf +
                                   "' is over 1 PiB; did you mean a smaller unit?");
  }
  return static_cast<uint64_t>(std::llround(bytes));
}

std::string FormatBytes(uint64_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (bytes >= (1ull << 30))
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1ull << 30));
  else if (bytes >= (1ull << 20))
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1ull << 20));
  else if (bytes >= (1ull << 10))
    std::snprintf(buf, sizeof buf, "%.2f KiB", b / (1ull << 10));
  else
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  return buf;
}

}  // namespace emsa
