// Precompiled header for the tests and their rank programs (built without optimisation).
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn.h>
#include <torch/csrc/api/include/torch/optim.h>
#include <torch/csrc/api/include/torch/serialize.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
