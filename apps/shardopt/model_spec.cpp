#include "model_spec.h"

#include "models/cnn.h"

#include <shardopt/check.h>
#include "models/gpt2.h"
#include "models/llama.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>

namespace shardopt::app {

int64_t ModelSpec::numel() const {
  int64_t n = 0;
  for (const auto& l : layers) {
    int64_t k = 1;
    for (int64_t d : l.shape) k *= d;
    n += k;
  }
  return n;
}

ModelSpec preset_spec(const std::string& name) {
  ModelSpec s;
  s.name = name;
  if (name == "cnn") {
    Cnn cnn;
    for (const auto& p : cnn.named_parameters()) s.layers.push_back({p.key(), p.value().sizes().vec()});
  } else if (name == "gpt2-mini") {
    for (const auto& layer : models::gpt2_shapes(512, 10000, 512, 6)) s.layers.push_back({layer.name, layer.shape});
  } else if (name == "gpt2-small") {
    for (const auto& layer : models::gpt2_shapes()) s.layers.push_back({layer.name, layer.shape});
  } else if (name == "many-small") {
    for (int l = 0; l < 500; ++l) {
      s.layers.push_back({fmt::format("layer{}.weight", l), {64, 64}});
      s.layers.push_back({fmt::format("layer{}.bias", l), {64}});
    }
  } else if (name == "llama-7b" || name == "llama-70b") {
    for (const auto& layer : models::llama_shapes(name == "llama-7b" ? models::llama_7b() : models::llama_70b())) {
      s.layers.push_back({layer.name, layer.shape});
    }
  } else {
    SHARDOPT_CHECK(false, "--preset '", name, "' is not one of cnn, gpt2-mini, gpt2-small, many-small, llama-7b, llama-70b");
  }
  return s;
}

ModelSpec read_spec(const std::string& path) {
  std::ifstream f(path);
  SHARDOPT_CHECK(f, "--spec '", path, "' cannot be opened");
  nlohmann::json j;
  try {
    f >> j;
  } catch (const std::exception& e) {
    SHARDOPT_CHECK(false, "--spec '", path, "' is not valid JSON: ", std::string(e.what()).substr(0, 200));
  }
  SHARDOPT_CHECK(j.is_object() && j.contains("layers") && j["layers"].is_array() && !j["layers"].empty(), "--spec '",
                 path, "' needs {\"layers\": [{\"name\": ..., \"shape\": [...]}, ...]} with at least one layer");
  ModelSpec s;
  s.name = path;
  for (size_t i = 0; i < j["layers"].size(); ++i) {
    const auto& l = j["layers"][i];
    SHARDOPT_CHECK(l.is_object() && l.contains("shape") && l["shape"].is_array() && !l["shape"].empty(), "--spec '",
                   path, "': layer ", i, " needs a non-empty \"shape\" list");
    LayerShape shape;
    shape.name = l.contains("name") && l["name"].is_string() ? l["name"].get<std::string>() : fmt::format("layer{}", i);
    int64_t numel = 1;
    for (const auto& dim : l["shape"]) {
      SHARDOPT_CHECK(dim.is_number_integer() && dim.get<int64_t>() > 0, "--spec '", path, "': layer ", i, " ('",
                     shape.name, "') has a dimension that is not a positive integer");
      SHARDOPT_CHECK(!__builtin_mul_overflow(numel, dim.get<int64_t>(), &numel) && numel <= (int64_t{1} << 50),
                     "--spec '", path, "': layer ", i, " ('", shape.name, "') has more than 2^50 elements");
      shape.shape.push_back(dim.get<int64_t>());
    }
    s.layers.push_back(shape);
  }
  return s;
}

ModelSpec model_spec(const std::string& preset, const std::string& spec) {
  return spec.empty() ? preset_spec(preset) : read_spec(spec);
}

bool muon_matrix(const LayerShape& layer) {
  if (layer.shape.size() < 2) return false;
  for (const char* excluded : {"wte", "wpe", "emb", "lm_head"}) {
    if (layer.name.find(excluded) != std::string::npos) return false;
  }
  return true;
}

}  // namespace shardopt::app
