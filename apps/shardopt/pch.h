// Precompiled header for the command-line tool and the benchmarks (which reuse it): the LibTorch
// headers they use most, and the option, JSON and format libraries, built optimised like them.
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/api/include/torch/nn.h>
#include <torch/csrc/api/include/torch/optim.h>
#include <torch/csrc/api/include/torch/serialize.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <fmt/format.h>
