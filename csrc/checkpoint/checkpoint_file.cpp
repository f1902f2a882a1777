// Checkpoint files: the header (magic, format version, payload length, CRC-32), the atomic
// write (a temporary file, fsync, rename, fsync of the folder) and the checked read.
#include <shardopt/checkpoint/checkpoint.h>
#include <shardopt/check.h>

#include "checkpoint/snapshot.h"

#include <torch/csrc/jit/serialization/pickle.h>
#include <zlib.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace shardopt {

namespace {
using detail::strip_prefix;

constexpr char kMagic[8] = {'S', 'H', 'R', 'D', 'C', 'K', 'P', 'T'};
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 8 + 4;

template <class T>
void put(std::vector<char>& out, T value) {  // little-endian, as every supported host is
  const char* p = reinterpret_cast<const char*>(&value);
  out.insert(out.end(), p, p + sizeof(T));
}
template <class T>
T get(const char* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

uint32_t crc_of(const char* data, size_t n) {
  uLong crc = crc32(0L, Z_NULL, 0);
  while (n > 0) {  // crc32 takes a uInt length
    const uInt chunk = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(data), chunk);
    data += chunk;
    n -= chunk;
  }
  return static_cast<uint32_t>(crc);
}

// The file's header for `body`: magic, format version, payload length, CRC-32 of the payload.
std::vector<char> checkpoint_header(const std::vector<char>& body) {
  std::vector<char> out;
  out.insert(out.end(), kMagic, kMagic + sizeof(kMagic));
  put<uint32_t>(out, kCheckpointFormatVersion);
  put<uint32_t>(out, 0);
  put<uint64_t>(out, body.size());
  put<uint32_t>(out, crc_of(body.data(), body.size()));
  return out;
}

std::string folder_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

void write_all(int fd, const char* data, size_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    SHARDOPT_CHECK(w > 0, "checkpoint '", path, "': write failed: ", std::strerror(errno));
    data += w;
    n -= static_cast<size_t>(w);
  }
}

// Makes `folder` and its parents where missing, as DCP does; errors name the folder.
void make_folders(const std::string& folder) {
  if (folder.empty() || folder == "." || folder == "/") return;
  struct stat st {};
  if (::stat(folder.c_str(), &st) == 0) {
    SHARDOPT_CHECK(S_ISDIR(st.st_mode), "'", folder, "' is not a folder");
    return;
  }
  make_folders(folder_of(folder));
  if (::mkdir(folder.c_str(), 0755) != 0 && errno != EEXIST) {
    SHARDOPT_CHECK(false, "cannot create the folder '", folder, "': ", std::strerror(errno));
  }
}

// Checks the header and the CRC, then unpickles the payload in place (the header is cut off
// the same buffer: no second copy of the payload).
torch::IValue parse_owned(std::vector<char> bytes, const std::string& path) {
  SHARDOPT_CHECK(bytes.size() >= kHeaderBytes && std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0,
                 "checkpoint '", path, "' is not a shardopt checkpoint (", bytes.size(), " bytes, no SHRDCKPT header)");
  const auto version = get<uint32_t>(bytes.data() + 8);
  SHARDOPT_CHECK(version == kCheckpointFormatVersion, "checkpoint '", path, "' has format version ", version,
                 "; this build reads version ", kCheckpointFormatVersion);
  const auto length = get<uint64_t>(bytes.data() + 16);
  const auto crc = get<uint32_t>(bytes.data() + 24);
  SHARDOPT_CHECK(bytes.size() - kHeaderBytes == length, "checkpoint '", path, "' is truncated or padded: the header ",
                 "announces ", length, " bytes of payload, the file holds ", bytes.size() - kHeaderBytes);
  const char* body = bytes.data() + kHeaderBytes;
  SHARDOPT_CHECK(crc_of(body, length) == crc, "checkpoint '", path, "' is corrupted (CRC-32 mismatch)");
  bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(kHeaderBytes));
  try {
    return torch::pickle_load(bytes);
  } catch (const std::exception& e) {
    SHARDOPT_CHECK(false, "checkpoint '", path, "': its payload does not unpickle: ", strip_prefix(e.what()));
  }
  return {};
}

}  // namespace

void write_checkpoint_file(const std::string& path, const torch::IValue& payload) {
  // The header and the payload go to the file one after the other: the payload is not copied
  // behind a header in memory.
  const std::vector<char> body = torch::pickle_save(payload);
  const std::vector<char> header = checkpoint_header(body);
  make_folders(folder_of(path));
  // Each writer its own temporary file: two writers of one path in one process (two threads, or a
  // save in flight beside another) never write into one file.
  static std::atomic<uint64_t> temporaries{0};
  const std::string tmp =
      path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(temporaries.fetch_add(1));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  SHARDOPT_CHECK(fd >= 0, "checkpoint '", path, "': cannot create '", tmp, "': ", std::strerror(errno));
  try {
    write_all(fd, header.data(), header.size(), path);
    write_all(fd, body.data(), body.size(), path);
    SHARDOPT_CHECK(::fsync(fd) == 0, "checkpoint '", path, "': fsync failed: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {  // (a network file system may report a failed write only here)
    const int err = errno;
    ::unlink(tmp.c_str());
    SHARDOPT_CHECK(false, "checkpoint '", path, "': closing the temporary file failed: ", std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    SHARDOPT_CHECK(false, "checkpoint '", path, "': cannot rename the temporary file into place: ", std::strerror(err));
  }
  // The rename itself is durable once the folder is. A file system that cannot sync a folder
  // (EINVAL) has nothing more to make durable; any other failure is the save's.
  const std::string folder = folder_of(path);
  const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  SHARDOPT_CHECK(dir >= 0, "checkpoint '", path, "': cannot open its folder '", folder, "' to sync it: ",
                 std::strerror(errno));
  const int synced = ::fsync(dir);
  const int err = errno;
  ::close(dir);
  SHARDOPT_CHECK(synced == 0 || err == EINVAL, "checkpoint '", path, "': syncing its folder '", folder,
                 "' failed (the file is in place but may not survive a power loss): ", std::strerror(err));
}

torch::IValue read_checkpoint_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  SHARDOPT_CHECK(fd >= 0, "checkpoint '", path, "': cannot open: ", std::strerror(errno));
  // Read into one buffer of the file's size (it grows only if the file did meanwhile).
  struct stat st {};
  std::vector<char> bytes(::fstat(fd, &st) == 0 && st.st_size > 0 ? static_cast<size_t>(st.st_size) : 0);
  size_t used = 0;
  for (;;) {
    if (used == bytes.size()) bytes.resize(std::max<size_t>(bytes.size() * 2, 1 << 16));
    const ssize_t n = ::read(fd, bytes.data() + used, bytes.size() - used);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    used += static_cast<size_t>(n);
  }
  ::close(fd);
  bytes.resize(used);
  return parse_owned(std::move(bytes), path);
}

torch::IValue parse_checkpoint(const std::vector<char>& bytes, const std::string& path) {
  return parse_owned(std::vector<char>(bytes), path);
}

std::vector<char> checkpoint_bytes(const torch::IValue& payload) {
  const std::vector<char> body = torch::pickle_save(payload);
  std::vector<char> out = checkpoint_header(body);
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

}  // namespace shardopt
