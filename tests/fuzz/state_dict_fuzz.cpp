// Fuzzes OSS::load_state_dict with arbitrary structures (decoded from the bytes). Only errors may
// come out: no crash, hang or unbounded allocation.
#include "fuzz_model.h"

#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickle.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  shardopt::fuzz::Target t;
  const torch::IValue value = shardopt::fuzz::Decoder(data, size).value();
  try {
    t.oss->load_state_dict(value);
  } catch (const c10::Error&) {
  }
  return 0;
}
