// Llama-class decoder shapes (Llama 2's layouts), for planning at scale: `shardopt plan`'s
// `llama-7b` and `llama-70b` presets. Header only.
#pragma once

#include "models/gpt2.h"

#include <cstdint>
#include <string>
#include <vector>

namespace shardopt::models {

struct LlamaShape {
  int64_t d = 4096;        // hidden size
  int64_t ffn = 11008;     // the MLP's inner size
  int64_t vocab = 32000;
  int layers = 32;
  int64_t kv_heads = 32;   // grouped-query attention: fewer key/value heads than query heads
  int64_t heads = 32;
};

// Llama 2 7B: 6,738,415,616 parameters in 291 tensors.
inline LlamaShape llama_7b() { return {}; }
// Llama 2 70B: 68,976,648,192 parameters in 723 tensors (8 key/value heads).
inline LlamaShape llama_70b() { return {8192, 28672, 32000, 80, 8, 64}; }

// The parameters in module order, with Hugging Face's names and [out, in] weights: the token
// embedding, `layers` blocks (attention q/k/v/o, the gated MLP, two RMSNorm weights), the final
// norm and the untied output layer.
inline std::vector<NamedShape> llama_shapes(const LlamaShape& m) {
  const int64_t kv = m.d / m.heads * m.kv_heads;
  std::vector<NamedShape> s = {{"model.embed_tokens.weight", {m.vocab, m.d}}};
  for (int l = 0; l < m.layers; ++l) {
    const std::string h = "model.layers." + std::to_string(l) + ".";
    s.push_back({h + "self_attn.q_proj.weight", {m.d, m.d}});
    s.push_back({h + "self_attn.k_proj.weight", {kv, m.d}});
    s.push_back({h + "self_attn.v_proj.weight", {kv, m.d}});
    s.push_back({h + "self_attn.o_proj.weight", {m.d, m.d}});
    s.push_back({h + "mlp.gate_proj.weight", {m.ffn, m.d}});
    s.push_back({h + "mlp.up_proj.weight", {m.ffn, m.d}});
    s.push_back({h + "mlp.down_proj.weight", {m.d, m.ffn}});
    s.push_back({h + "input_layernorm.weight", {m.d}});
    s.push_back({h + "post_attention_layernorm.weight", {m.d}});
  }
  s.push_back({"model.norm.weight", {m.d}});
  s.push_back({"lm_head.weight", {m.vocab, m.d}});
  return s;
}

}  // namespace shardopt::models
