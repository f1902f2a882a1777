// Error checks for the whole library.
//
//   SHARDOPT_CHECK(cond, "what went wrong: ", value, ...)   a user error: c10::Error whose message
//                                                          starts with "shardopt: "
//   TORCH_INTERNAL_ASSERT(cond, ...)                       an invariant of shardopt itself (offsets,
//                                                          counts, ranges): a bug if it fires
//
// A message names the bad value, parameter, rank or option, and says what to do where that is
// not obvious.
#pragma once

#include <c10/util/Exception.h>

#define SHARDOPT_CHECK(cond, ...) TORCH_CHECK((cond), "shardopt: ", __VA_ARGS__)
