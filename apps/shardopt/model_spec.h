// Model shapes for `shardopt memory`: presets and a JSON spec a user writes.
//
//   {"layers": [{"name": "embed", "shape": [50257, 768]}, {"name": "fc", "shape": [768, 768]}]}
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardopt::app {

struct LayerShape {
  std::string name;
  std::vector<int64_t> shape;
};

struct ModelSpec {
  std::string name;
  std::vector<LayerShape> layers;
  int64_t numel() const;
};

// "cnn" (the train command's CNN), "gpt2-mini" (GPT-2's shapes at width 512, 6 blocks, a
// vocabulary of 10,000 and 512 positions: 24,297,472 parameters in 76 tensors, the shape of the
// benchmarks), "gpt2-small" (GPT-2 small's 124M parameters in its 148 tensor shapes, the output
// layer tied to the embedding), "many-small" (1,000 tensors: 500 layers of
// 64x64 and a bias), "llama-7b" and "llama-70b" (Llama 2's shapes: 6.74B parameters in 291
// tensors, 69.0B in 723). An unknown name is an error listing the presets.
ModelSpec preset_spec(const std::string& name);

// Reads a JSON spec; errors name the file and the bad entry.
ModelSpec read_spec(const std::string& path);

// A preset's shapes, or a spec file's when `spec` is not empty.
ModelSpec model_spec(const std::string& preset, const std::string& spec);

// --optimizer muon: whether Muon steps this layer: a weight of two or more dimensions that is not
// an embedding or the output layer (a name containing "wte", "wpe", "emb" or "lm_head"), conv
// filters taken as matrices. Adam steps the rest.
bool muon_matrix(const LayerShape& layer);

}  // namespace shardopt::app
