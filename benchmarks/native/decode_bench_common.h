#pragma once
// What the two decode benchmarks (decode_kernel_rate.cpp, decode_engine_loop.cpp) share: the expert
// shapes they time, their comma-list arguments, the clock, and the --variants filter over the
// kernel builds the binary holds (kernel_variants.h).
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

namespace hmoe {

struct DecodeShape {
  const char* name;
  int H, I, E, K;  // hidden, expert intermediate, routed experts, experts per token
};
inline constexpr DecodeShape kDecodeShapes[] = {{"deepseek-v3", 7168, 2048, 256, 8},
                                                {"qwen3-30b-a3b", 2048, 768, 128, 8}};

// nullptr for a name not in kDecodeShapes
inline const DecodeShape* find_decode_shape(const std::string& name) {
  for (const DecodeShape& s : kDecodeShapes)
    if (name == s.name) return &s;
  return nullptr;
}

inline std::vector<std::string> str_list(const std::string& s) {
  std::vector<std::string> out;
  size_t a = 0;
  for (size_t b; (b = s.find(',', a)) != std::string::npos; a = b + 1) out.push_back(s.substr(a, b - a));
  out.push_back(s.substr(a));
  return out;
}

inline std::vector<int> int_list(const std::string& s) {
  std::vector<int> out;
  for (const auto& v : str_list(s)) out.push_back(std::atoi(v.c_str()));
  return out;
}

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// --variants: a comma list of build names ("" = every build)
inline bool variant_chosen(const char* name, const std::string& names) {
  return names.empty() || ("," + names + ",").find("," + std::string(name) + ",") != std::string::npos;
}

}  // namespace hmoe
