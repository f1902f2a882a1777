// How gradients and parameters travel between ranks (Note [Gradient wire] and Note [Parameter
// wire] in csrc/comm/wire.cpp): exactly, in their own dtype, or compressed.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

namespace shardopt {

// kExact: the tensors' own dtype (fp32 gradients travel as fp32), the default.
// kBFloat16: each gradient contribution travels rounded to bf16 and is summed in fp32 where it
// arrives; each parameter range travels rounded to bf16, and every rank holds the rounded values.
// kInt8: int8 in blocks of 256 elements with one fp32 scale each (Note [Int8 wire]); on Gloo by
// direct transfers, on NCCL in its all-to-all and gather (Note [Int8 wire on collectives]).
enum class Wire { kExact, kBFloat16, kInt8 };

// "exact", "bf16", "int8", and back (an unknown name is an error naming it).
std::string wire_name(Wire wire);
Wire wire_from_name(const std::string& name);
// The dtype a tensor of `dtype` travels in under `wire`; nullopt where it travels as it is
// (kExact, or under kBFloat16 a tensor that already is bf16 or narrower). kInt8 gives kChar for
// every floating dtype: block-quantised int8 (Note [Int8 wire]).
std::optional<at::ScalarType> wire_dtype(Wire wire, at::ScalarType dtype);

}  // namespace shardopt
