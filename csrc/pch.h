// The precompiled header shared by every target: the LibTorch headers the project uses most.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/optim.h>
#include <torch/csrc/api/include/torch/serialize.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
