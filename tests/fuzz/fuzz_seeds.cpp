// Writes the fuzzers' starting corpus into DIR/<target>/: a real checkpoint's bytes, a real
// sampler state, and a few decoder inputs (dicts and lists) for the structured targets.
#include "fuzz_model.h"

#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdio>
#include <string>
#include <sys/stat.h>

namespace {

void put(const std::string& path, char first, const std::vector<char>& bytes, bool with_first = true) {
  FILE* f = std::fopen(path.c_str(), "wb");
  TORCH_CHECK(f, "cannot write ", path);
  if (with_first) std::fputc(first, f);
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  TORCH_CHECK(argc == 2, "usage: fuzz_seeds DIR");
  const std::string dir = argv[1];
  for (const char* sub : {"", "/checkpoint", "/state_dict", "/sampler_state"}) ::mkdir((dir + sub).c_str(), 0755);
  shardopt::fuzz::Target t;
  const std::string ckpt = dir + "/seed.ckpt";
  shardopt::TrainingState state;
  state.step = 5;
  state.sampler = t.sampler->state(3);
  shardopt::save_checkpoint(ckpt, *t.model, *t.oss, state);
  const torch::IValue payload = shardopt::read_checkpoint_file(ckpt);
  put(dir + "/checkpoint/raw", 0, shardopt::checkpoint_bytes(payload));
  // Decoder inputs: a dict of two entries ("state" -> dict, "param_groups" -> list of a dict).
  const std::vector<char> dict = {0, 2, 1, 0, 0, 1, 0, 2, 3, 1, 1, 0, 1, 1, 2, 3, 4};
  put(dir + "/checkpoint/payload", 1, dict);
  put(dir + "/state_dict/dict", 0, dict, false);
  const auto fields = t.sampler->state(3).to_fields();
  put(dir + "/sampler_state/seed", 0, std::vector<char>(reinterpret_cast<const char*>(fields.data()),
                                                        reinterpret_cast<const char*>(fields.data()) + sizeof(fields)), false);
  std::printf("seeds written to %s\n", dir.c_str());
  return 0;
}
