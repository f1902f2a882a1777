// Fuzzes the checkpoint loader: the first byte picks raw file bytes (header, version, length,
// checksum checks) or a decoded value wrapped in a valid header and checksum (then every check
// load_checkpoint makes on the payload's structure). Only shardopt errors may come out.
#include "fuzz_model.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <unistd.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  shardopt::fuzz::Target t;
  std::vector<char> bytes(reinterpret_cast<const char*>(data) + 1, reinterpret_cast<const char*>(data) + size);
  if (data[0] & 1) {  // a valid envelope around a decoded payload
    bytes = shardopt::checkpoint_bytes(shardopt::fuzz::Decoder(data + 1, size - 1).value());
  }
  // (removed when the fuzzer exits)
  static const struct File {
    std::string path = "/tmp/shardopt-checkpoint-fuzz-" + std::to_string(::getpid()) + ".ckpt";
    ~File() { std::remove(path.c_str()); }
  } file;
  const std::string& path = file.path;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
  try {
    shardopt::load_checkpoint(path, *t.model, *t.oss);
  } catch (const c10::Error&) {
    // a clear error: what the loader must give for bad bytes
  }
  return 0;
}
