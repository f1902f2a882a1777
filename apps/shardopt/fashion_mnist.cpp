#include "fashion_mnist.h"

#include <shardopt/check.h>

#include <ATen/ATen.h>
#include <zlib.h>

#include <sys/stat.h>

#include <memory>

namespace shardopt::app {

namespace {

// Reads a gzipped IDX file (big-endian header: magic 0x0000 08 <dims>, one uint32 per dim, then
// uint8 data) into a uint8 tensor; `limit` > 0 keeps only the first `limit` items and decompresses
// no further (a run on 1,920 images inflates 1.5 MB of the 47 MB training set).
at::Tensor read_idx(const std::string& path, int64_t limit) {
  std::unique_ptr<gzFile_s, int (*)(gzFile)> f(gzopen(path.c_str(), "rb"), gzclose);
  SHARDOPT_CHECK(f, "cannot open '", path, "'");
  auto read_u32 = [&] {
    unsigned char b[4];
    SHARDOPT_CHECK(gzread(f.get(), b, 4) == 4, "'", path, "' is truncated (IDX header)");
    return (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) | (uint32_t(b[2]) << 8) | uint32_t(b[3]);
  };
  const uint32_t magic = read_u32();
  SHARDOPT_CHECK((magic >> 8) == 0x08 && (magic & 0xff) >= 1 && (magic & 0xff) <= 3, "'", path,
                 "' is not an IDX file of bytes (magic ", magic, ")");
  std::vector<int64_t> dims(magic & 0xff);
  for (auto& d : dims) d = read_u32();
  if (limit > 0 && limit < dims[0]) dims[0] = limit;
  at::Tensor t = at::empty(dims, at::kByte);
  const int64_t n = t.numel();
  SHARDOPT_CHECK(gzread(f.get(), t.data_ptr<uint8_t>(), static_cast<unsigned>(n)) == n, "'", path,
                 "' is truncated (", n, " bytes of data expected)");
  return t;
}

}  // namespace

FashionMnist load_fashion_mnist(const std::string& dir, int64_t train_limit, int64_t test_limit) {
  struct stat st {};
  SHARDOPT_CHECK(::stat(dir.c_str(), &st) == 0, "data folder '", dir,
                 "' does not exist (install Debian's dataset-fashion-mnist, or pass --data)");
  SHARDOPT_CHECK(S_ISDIR(st.st_mode), "--data '", dir, "' is not a folder (pass the folder with Fashion-MNIST's files)");
  FashionMnist d;
  d.train_images = read_idx(dir + "/train-images-idx3-ubyte.gz", train_limit);
  d.train_labels = read_idx(dir + "/train-labels-idx1-ubyte.gz", train_limit).to(at::kLong);
  d.test_images = read_idx(dir + "/t10k-images-idx3-ubyte.gz", test_limit);
  d.test_labels = read_idx(dir + "/t10k-labels-idx1-ubyte.gz", test_limit).to(at::kLong);
  SHARDOPT_CHECK(d.train_images.size(0) == d.train_labels.size(0) && d.test_images.size(0) == d.test_labels.size(0),
                 "images and labels in '", dir, "' differ in count");
  return d;
}

at::Tensor normalise(const at::Tensor& images) {
  return images.to(at::kFloat).div_(255).sub_(0.2860).div_(0.3530).unsqueeze(1);
}

}  // namespace shardopt::app
