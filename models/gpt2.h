// GPT-2's parameter shapes, the one definition the C++ side of shardopt uses (the `gpt2-small`
// preset of `shardopt memory`, the benchmarks of the step). Header only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardopt::models {

struct NamedShape {
  std::string name;
  std::vector<int64_t> shape;
};

// GPT-2's parameters in the order of its modules, with Hugging Face's names and layouts (Conv1D
// weights are [in, out]): token and position embeddings, `blocks` transformer blocks of width `d`,
// the final layer norm. The defaults are GPT-2 small: 148 tensors, 124,439,808 elements.
inline std::vector<NamedShape> gpt2_shapes(int64_t d = 768, int64_t vocab = 50257, int64_t positions = 1024,
                                           int blocks = 12) {
  std::vector<NamedShape> s = {{"wte", {vocab, d}}, {"wpe", {positions, d}}};
  for (int b = 0; b < blocks; ++b) {
    const std::string h = "h" + std::to_string(b) + ".";
    s.push_back({h + "ln_1.weight", {d}});
    s.push_back({h + "ln_1.bias", {d}});
    s.push_back({h + "attn.c_attn.weight", {d, 3 * d}});
    s.push_back({h + "attn.c_attn.bias", {3 * d}});
    s.push_back({h + "attn.c_proj.weight", {d, d}});
    s.push_back({h + "attn.c_proj.bias", {d}});
    s.push_back({h + "ln_2.weight", {d}});
    s.push_back({h + "ln_2.bias", {d}});
    s.push_back({h + "mlp.c_fc.weight", {d, 4 * d}});
    s.push_back({h + "mlp.c_fc.bias", {4 * d}});
    s.push_back({h + "mlp.c_proj.weight", {4 * d, d}});
    s.push_back({h + "mlp.c_proj.bias", {d}});
  }
  s.push_back({"ln_f.weight", {d}});
  s.push_back({"ln_f.bias", {d}});
  return s;
}

}  // namespace shardopt::models
