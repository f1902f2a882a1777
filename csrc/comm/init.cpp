// Creating process groups: init_process_group from a store, env://, tcp:// or file://; the
// agreement every rank checks at the join (shardopt version, backend, world size, timeout); the
// NCCL or Gloo backend behind the group; the launcher's local rank.
#include <shardopt/comm/process_group.h>
#include <shardopt/comm/store_server.h>
#include <shardopt/check.h>
#include <shardopt/comm/agree.h>
#include <shardopt/comm/launch_env.h>
#include <shardopt/version.h>

#include "comm/backends.h"
#include "comm/heartbeat.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <cerrno>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sstream>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <thread>
#include <unistd.h>

namespace shardopt {

// The set-up of a group init_process_group makes (private to ProcessGroup: user code gets
// groups only from init_process_group and split).
struct detail::GroupSetup {
  static void store(ProcessGroup& group, c10::intrusive_ptr<c10d::Store> store) { group.set_store(std::move(store)); }
  static void backend_factory(ProcessGroup& group, ProcessGroup::BackendFactory factory) {
    group.set_backend_factory(std::move(factory));
  }
  static void joining(ProcessGroup& group, int global_rank, c10::intrusive_ptr<c10d::Store> store) {
    group.set_joining(global_rank, std::move(store));
  }
};

namespace {

int parse_int(const std::string& text, const std::string& what) {
  try {
    size_t pos = 0;
    int v = std::stoi(text, &pos);
    TORCH_CHECK(pos == text.size(), "trailing characters");
    return v;
  } catch (const std::exception&) {
    SHARDOPT_CHECK(false, "", what, " must be an integer, got '", text, "'");
  }
}

}  // namespace

int local_rank() {
  for (const char* name : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    if (const char* v = env_var(name)) {
      const int r = parse_int(v, name);
      SHARDOPT_CHECK(r >= 0, name, " must be >= 0, got ", r);
      return r;
    }
  }
  return -1;
}

namespace {

// Rank and world size from the launcher's variables where the options leave them open.
void rank_from_env(InitOptions& options) {
  if (options.rank() >= 0 && options.world_size() >= 0) return;
  const LaunchEnv e = read_launch_env(/*need_master=*/false);
  if (options.rank() < 0) options.rank(e.rank);
  if (options.world_size() < 0) options.world_size(e.world_size);
}

// "1.2.3" as 1002003, and back, for the join agreement.
int64_t version_number(const std::string& v) {
  int64_t major = 0, minor = 0, patch = 0;
  std::sscanf(v.c_str(), "%ld.%ld.%ld", &major, &minor, &patch);
  return major * 1000000 + minor * 1000 + patch;
}
std::string version_text(const std::vector<int64_t>& v) {
  return std::to_string(v[0] / 1000000) + "." + std::to_string(v[0] / 1000 % 1000) + "." + std::to_string(v[0] % 1000);
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// The backend a rank asks for: "nccl" for nccl (usable or not: the ranks agree on the request
// first, then each checks it can serve it), "auto" resolved on this rank. Errors name a backend
// that does not exist.
std::string resolve_backend(const std::string& requested) {
  SHARDOPT_CHECK(requested == "auto" || requested == "gloo" || requested == "nccl",
              "unknown backend '", requested, "' (expected \"gloo\", \"nccl\" or \"auto\")");
  if (requested == "nccl") return "nccl";
  if (requested == "auto" && detail::nccl_usable()) return "nccl";
  return "gloo";
}

// After the ranks agreed on the backend: whether this rank can serve NCCL.
void check_backend_usable(const std::string& backend) {
  if (backend != "nccl") return;
  SHARDOPT_CHECK(detail::nccl_compiled(), "backend 'nccl' was requested but this build has no NCCL "
                 "backend; use \"gloo\" (CPU tensors)");
  SHARDOPT_CHECK(detail::nccl_usable(), "backend 'nccl' was requested but no CUDA device is visible");
}

// InitOptions::check_desync, or SHARDOPT_CHECK_DESYNC=1.
bool checks_desync(const InitOptions& options) {
  const char* env = env_var("SHARDOPT_CHECK_DESYNC");
  return options.check_desync() || (env && std::string(env) == "1");
}

void agree_on_init_fields(c10d::Store& store, const InitOptions& options, const std::string& backend);

// The store key a process claims its rank under, before the agreement below.
std::string claim_key(int rank) { return "shardopt/init/claimed/" + std::to_string(rank); }

// A rank that two processes claimed, or -1.
int rank_claimed_twice(c10d::Store& store, int world_size) {
  for (int r = 0; r < world_size; ++r) {
    if (store.add(claim_key(r), 0) > 1) return r;
  }
  return -1;
}

// Every rank learns, before any backend connects, whether the ranks were started alike: a rank
// that chose another backend or world size would otherwise leave the others waiting. A process
// started with a rank another process already has (two with RANK=1) fails at once naming it; the
// others, waiting for the rank nobody took, name it at their timeout instead of only the missing
// rank.
// `address` names the store ("127.0.0.1:29500"; empty for a store the caller made): the rank
// another process holds may be another job's, started on the same port.
void agree_on_init(c10d::Store& store, const InitOptions& options, const std::string& backend,
                   const std::string& address) {
  const std::string twice = " was started twice: two processes have RANK (or the launcher's rank variable) ";
  const std::string other_job = address.empty() ? "" : " (or another job's rendezvous is at " + address +
                                " too: give each job its own MASTER_PORT)";
  SHARDOPT_CHECK(store.add(claim_key(options.rank()), 1) == 1, "init_process_group: rank ", options.rank(), twice,
                 options.rank(), " in a world of ", options.world_size(), "; each rank must be started once",
                 other_job);
  try {
    agree_on_init_fields(store, options, backend);
  } catch (const c10::Error& e) {
    // (Rank 0 may have refused the same disagreement and gone, taking the store's server with it:
    // the disagreement is then this rank's error, not the store's.)
    int dup = -1;
    try {
      dup = rank_claimed_twice(store, options.world_size());
    } catch (const std::exception&) {
    }
    if (dup < 0) throw;
    SHARDOPT_CHECK(false, "init_process_group: rank ", dup, twice, dup, other_job, ", so another rank never came (rank ",
                   options.rank(), " of ", options.world_size(), ": ", e.what_without_backtrace(), ")");
  }
}

void agree_on_init_fields(c10d::Store& store, const InitOptions& options, const std::string& backend) {
  // SHARDOPT_ANNOUNCE_VERSION replaces the announced shardopt version (to test the refusal).
  // SHARDOPT_ANNOUNCE_TORCH_VERSION the LibTorch version.
  const char* announced = env_var("SHARDOPT_ANNOUNCE_VERSION");
  const char* announced_torch = env_var("SHARDOPT_ANNOUNCE_TORCH_VERSION");
  Agreement("init_process_group")
      .field("world_size", options.world_size())
      .field("shardopt version", version_number(announced && *announced ? announced : version()), version_text)
      .field("LibTorch version", version_number(announced_torch && *announced_torch ? announced_torch : torch_version()),
             version_text)
      .field("backend", backend == "nccl" ? 1 : 0,
             [](const std::vector<int64_t>& v) { return std::string(v[0] ? "nccl" : "gloo"); })
      .field("timeout (ms)", static_cast<int64_t>(options.timeout().count()))
      // (A rank that checks sends a check before each collective that the others never expect.)
      .field("desync check (check_desync or SHARDOPT_CHECK_DESYNC=1)", checks_desync(options) ? 1 : 0,
             [](const std::vector<int64_t>& v) { return std::string(v[0] ? "on" : "off"); })
      .hint("start every rank with the same options")
      .check(store, "init_process_group", options.rank(), options.world_size());
}

// How long forming the group may take (InitOptions::setup_timeout).
std::chrono::milliseconds setup_timeout(const InitOptions& options) {
  return options.setup_timeout().count() > 0 ? options.setup_timeout() : options.timeout();
}

std::shared_ptr<ProcessGroup> finish_group(std::shared_ptr<ProcessGroup> group, const c10::intrusive_ptr<c10d::Store>& store,
                                           const InitOptions& options) {
  detail::GroupSetup::store(*group, store);
  group->set_check_desync(checks_desync(options));
  return group;
}

// Note [The transport's interfaces]
// GLOO_SOCKET_IFNAME names the network interfaces the ranks talk over, comma-separated, as it
// does for PyTorch's Gloo groups: one device per interface, and it wins over everything else.
// Without it, a loopback rendezvous talks over 127.0.0.1, and any other over the address this
// host's name resolves to (c10d's default device, which falls back to loopback). The names are
// checked before the rendezvous (that the host has each, with an IP address), so that a name
// this host lacks is the rank's own error, not a peer's failure to reach a rank 0 that has gone.
// Whether interface `name` has an IPv4 or IPv6 address (what Gloo binds its device to).
bool has_ip_address(const std::string& name) {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return true;  // cannot tell: Gloo's own error will name it
  bool found = false;
  for (ifaddrs* a = all; a && !found; a = a->ifa_next) {
    found = a->ifa_addr && name == a->ifa_name &&
            (a->ifa_addr->sa_family == AF_INET || a->ifa_addr->sa_family == AF_INET6);
  }
  ::freeifaddrs(all);
  return found;
}

std::vector<std::string> socket_interfaces() {
  std::vector<std::string> names;
  const char* v = env_var("GLOO_SOCKET_IFNAME");
  if (!v) return names;
  std::stringstream list(v);
  for (std::string name; std::getline(list, name, ',');) {
    SHARDOPT_CHECK(!name.empty(), "GLOO_SOCKET_IFNAME='", v, "' names an empty interface (expected names "
                   "separated by commas, such as eth0 or eth0,eth1)");
    SHARDOPT_CHECK(::if_nametoindex(name.c_str()) != 0, "GLOO_SOCKET_IFNAME: no interface '", name,
                   "' on this host (GLOO_SOCKET_IFNAME='", v, "')");
    SHARDOPT_CHECK(has_ip_address(name), "GLOO_SOCKET_IFNAME: interface '", name, "' has no IP address (",
                   "GLOO_SOCKET_IFNAME='", v, "')");
    names.push_back(name);
  }
  return names;
}

// Note [The transport thread's scheduling]
// Gloo's TCP transport has one thread per device that polls the sockets (level-triggered epoll)
// and reads what arrives. When a message is waiting but another thread holds that peer's lock
// (a send writes its whole payload with the lock held), the transport thread cannot take it and
// goes straight back to epoll, which reports the same socket again: it spins until the lock is
// free. On a machine with more busy threads than cores, its wake-up can preempt the lock holder,
// and then it burns its whole time slice (on 2 cores with 2 ranks, hundreds of empty polls per
// step of the small-tensor model, and bursts of longer steps: docs/benchmarks-log.md).
// Under SCHED_BATCH its wake-ups no longer preempt the running thread, while it keeps its full
// share of a core for reading large messages when every core is busy; a nice value lowers that
// share too (faster when the cores are otherwise idle, much slower when they are not:
// docs/gloo.md). A Linux thread inherits its creator's policy and nice value, and the device
// starts its thread when it is made, so the device is made on a short-lived thread set up that
// way: no other thread changes, and no privilege is needed (only raising a priority needs one).
// Both are hints: where the system refuses them, the thread keeps the caller's scheduling.
c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> gloo_options(std::chrono::milliseconds timeout, bool loopback,
                                                                  const std::vector<std::string>& interfaces,
                                                                  bool batch, int nice) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  auto make_devices = [loopback, &interfaces] {
    std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
    for (const auto& name : interfaces) {
      try {
        devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
      } catch (const std::exception& e) {  // Gloo's own enforce error is no c10::Error
        std::string why = e.what();
        why = why.substr(0, why.find('\n'));
        SHARDOPT_CHECK(false, "GLOO_SOCKET_IFNAME: interface '", name, "' is not usable (", why, ")");
      }
    }
    if (devices.empty()) {
      devices.push_back(loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                 : c10d::ProcessGroupGloo::createDefaultDevice());
    }
    return devices;
  };
  std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
  if (!batch && nice == 0) {
    devices = make_devices();  // the caller's scheduling: no thread to set up
  } else {
    std::exception_ptr error;
    std::thread maker([&] {
      try {
        if (batch) {
          sched_param param{};
          param.sched_priority = 0;
          ::pthread_setschedparam(::pthread_self(), SCHED_BATCH, &param);
        }
        if (nice > 0) {
          const auto tid = static_cast<id_t>(::syscall(SYS_gettid));
          errno = 0;
          const int current = ::getpriority(PRIO_PROCESS, tid);
          if (errno == 0) ::setpriority(PRIO_PROCESS, tid, std::min(19, current + nice));
        }
        devices = make_devices();
      } catch (...) {
        error = std::current_exception();
      }
    });
    maker.join();
    if (error) std::rethrow_exception(error);
  }
  opts->devices = std::move(devices);
  opts->threads = 1;
  return opts;
}

// Note [SIGPIPE]
// Gloo writes to its sockets with writev, and a write to a peer that has gone raises SIGPIPE,
// whose default action ends the process before Gloo can report the error (a rank dies, and the
// ranks still sending to it die silently instead of naming it). Python ignores SIGPIPE at start-
// up, so PyTorch's Gloo groups never see it; a C++ program has the default. A Gloo group sets it to
// ignored when it has the default action, so the write fails with EPIPE and the collective with
// an error; a handler the program installed is left alone.
void ignore_sigpipe_by_default() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) != 0) return;
  if ((current.sa_flags & SA_SIGINFO) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

// `host` and `port` are the store's address, where this process reached it by one (else "" and 0).
std::shared_ptr<ProcessGroup> make_group(const c10::intrusive_ptr<c10d::Store>& store,
                                         const InitOptions& options, const std::string& host, int port = 0) {
  const std::string backend = resolve_backend(options.backend());
  // Note [Closed rendezvous]: a job is under way in this store; it admits this process rather
  // than the first rendezvous, which is long over.
  const bool joining = rendezvous_closed(*store);
  if (!joining) agree_on_init(*store, options, backend, host.empty() ? "" : host + ":" + std::to_string(port));
  check_backend_usable(backend);
  ProcessGroup::BackendFactory factory;
  if (backend == "nccl") {
    // (NCCL's own timeout is its watchdog's over every collective: the group's.)
    factory = [timeout = options.timeout()](const c10::intrusive_ptr<c10d::Store>& s, int rank, int size) {
      return detail::make_nccl_backend(s, rank, size, timeout);
    };
  } else {
    const bool loopback = host.empty() || is_loopback(host);
    // (Gloo's context timeout bounds its connections; every collective passes the group's own.)
    factory = [timeout = setup_timeout(options), loopback, interfaces = socket_interfaces(),
               batch = options.transport_thread_batch(),
               nice = options.transport_thread_nice()](const c10::intrusive_ptr<c10d::Store>& s, int rank, int size) {
      return c10::intrusive_ptr<c10d::Backend>(c10::make_intrusive<c10d::ProcessGroupGloo>(
          s, rank, size, gloo_options(timeout, loopback, interfaces, batch, nice)));
    };
  }
  if (joining) {
    SHARDOPT_CHECK(backend == "gloo", "rank ", options.rank(), " arrived after its job's rendezvous closed (it was ",
                   "started to replace a rank of a job that went on after a death), which is not supported on ",
                   "NCCL yet");
    // A group of one over a store of its own until the job admits it.
    auto alone = factory(c10::make_intrusive<c10d::HashStore>(), 0, 1);
    auto group = std::make_shared<ProcessGroup>(alone, options.timeout());
    detail::GroupSetup::backend_factory(*group, factory);
    detail::GroupSetup::joining(*group, options.rank(), store);
    group->set_check_desync(checks_desync(options));  // the group it joins checks as it was started
    return group;
  }
  if (backend == "nccl") {
    try {
      auto pg = factory(store, options.rank(), options.world_size());
      auto group = std::make_shared<ProcessGroup>(pg, options.timeout());
      detail::GroupSetup::backend_factory(*group, factory);
      return finish_group(group, store, options);
    } catch (const std::exception& e) {
      SHARDOPT_CHECK(false, "rank ", options.rank(), " of ", options.world_size(),
                  " could not create its NCCL group (timeout ", options.timeout().count(), " ms): ", e.what());
    }
  }
  ignore_sigpipe_by_default();
  try {
    auto pg = factory(store, options.rank(), options.world_size());
    // Note [Every rank connected before any returns]
    // Gloo's mesh is complete on a rank once its own pairs are: it can return, fail at its next
    // step (a missing data folder) and exit while a peer is still connecting, which then fails
    // with "connection closed" instead of its own error. A barrier on the new backend (not counted
    // in the group's stats) returns only when every rank has connected.
    c10d::BarrierOptions barrier;
    barrier.timeout = setup_timeout(options);
    if (options.world_size() > 1) pg->barrier(barrier)->wait(setup_timeout(options));
    auto group = std::make_shared<ProcessGroup>(pg, options.timeout());
    detail::GroupSetup::backend_factory(*group, factory);
    return finish_group(group, store, options);
  } catch (const std::exception& e) {
    SHARDOPT_CHECK(false, "rank ", options.rank(), " of ", options.world_size(),
                " could not connect to its peers within ", setup_timeout(options).count(),
                " ms (init_method '", options.init_method(), "'; a rank may not have started): ", e.what());
  }
}

void check_rank(const InitOptions& options) {
  SHARDOPT_CHECK(options.world_size() >= 1, "world_size must be at least 1, got ", options.world_size());
  SHARDOPT_CHECK(options.rank() >= 0 && options.rank() < options.world_size(), "rank ",
              options.rank(), " is outside [0, ", options.world_size(), ")");
  SHARDOPT_CHECK(options.timeout().count() > 0, "timeout must be positive, got ",
              options.timeout().count(), " ms");
  SHARDOPT_CHECK(options.setup_timeout().count() >= 0, "setup_timeout must be positive (or 0: the timeout), got ",
                 options.setup_timeout().count(), " ms");
  SHARDOPT_CHECK(options.transport_thread_nice() >= 0 && options.transport_thread_nice() <= 39,
                 "transport_thread_nice must be in [0, 39] (nice levels below the caller), got ",
                 options.transport_thread_nice());
}

// A socket bound to loopback host:port for a store's server (which otherwise listens on every
// interface); -1 for a host that is not loopback. Port 0 binds any free port, and `port` becomes
// it: the port comes from the bound socket, so no other process can take it in between. Errors
// name the address.
int loopback_listen_fd(const std::string& host, int& port, const std::string& who) {
  if (!is_loopback(host) || host == "::1") return -1;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  SHARDOPT_CHECK(fd >= 0, "cannot create the store's socket: ", std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, host == "localhost" ? "127.0.0.1" : host.c_str(), &addr.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    ::close(fd);
    SHARDOPT_CHECK(false, who, " cannot listen on ", host, ":", port, " for the rendezvous store: ", std::strerror(err));
  }
  socklen_t len = sizeof(addr);
  if (port == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) port = ntohs(addr.sin_port);
  return fd;
}

// Note [Waiting for the store]
// A rank that connects to the store (every rank but a serving rank 0) keeps trying until the
// setup timeout: the store may not be up yet. An address nothing answers at (a wrong MASTER_ADDR,
// a firewall) looks the same from here, so the wait is said out loud: while the rank connects, a
// timer prints one line every kStoreWaitNotice naming the rank, the address and how long it has
// waited, and at the setup timeout (give or take a try) the rank fails in one line. c10d's own
// log of each failed try (an error with a backtrace) is held back meanwhile.
constexpr std::chrono::seconds kStoreWaitNotice(30);

// c10's log level raised to FATAL while any of these lives (c10d's connection errors are said
// once, here); ranks that are threads of one process connect at once, so the first one in saves
// the level and the last one out restores it.
class QuietC10Log {
 public:
  QuietC10Log() {
    std::lock_guard<std::mutex> lock(mu());
    if (users()++ == 0) saved() = FLAGS_caffe2_log_level, FLAGS_caffe2_log_level = 3;
  }
  ~QuietC10Log() {
    std::lock_guard<std::mutex> lock(mu());
    if (--users() == 0) FLAGS_caffe2_log_level = saved();
  }
  QuietC10Log(const QuietC10Log&) = delete;
  QuietC10Log& operator=(const QuietC10Log&) = delete;

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static int& users() {
    static int n = 0;
    return n;
  }
  static int& saved() {
    static int level = 0;
    return level;
  }
};

// Prints the waiting line every kStoreWaitNotice until it is destroyed.
class StoreWaitNotices {
 public:
  StoreWaitNotices(int rank, const std::string& host, int port, std::chrono::milliseconds total)
      : thread_([this, rank, host, port, total] {
          const auto start = std::chrono::steady_clock::now();
          auto next = start + kStoreWaitNotice;
          std::unique_lock<std::mutex> lock(mu_);
          while (!done_.wait_until(lock, next, [this] { return finished_; })) {
            const auto waited = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - start);
            std::fprintf(stderr, "shardopt: rank %d has waited %lld s for the store at %s:%d (MASTER_ADDR, "
                         "MASTER_PORT); still trying, until the setup timeout of %lld s\n", rank,
                         static_cast<long long>(waited.count()), host.c_str(), port,
                         static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(total).count()));
            std::fflush(stderr);
            next += kStoreWaitNotice;
          }
        }) {}
  ~StoreWaitNotices() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      finished_ = true;
    }
    done_.notify_all();
    thread_.join();
  }
  StoreWaitNotices(const StoreWaitNotices&) = delete;
  StoreWaitNotices& operator=(const StoreWaitNotices&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable done_;
  bool finished_ = false;
  std::thread thread_;  // last: started once the members it uses exist
};

// Connects in tries of at most kStoreTry, until the setup timeout: c10d's client retries a try
// that timed out once more, so a single try of the whole timeout could take twice as long.
c10::intrusive_ptr<c10d::TCPStore> connect_store(const std::string& host, c10d::TCPStoreOptions opts, int rank) {
  if (opts.isServer) return c10::make_intrusive<c10d::TCPStore>(host, opts);
  constexpr std::chrono::milliseconds kStoreTry(5000);
  const auto total = std::chrono::duration_cast<std::chrono::milliseconds>(opts.timeout);
  const auto deadline = std::chrono::steady_clock::now() + total;
  const QuietC10Log quiet;
  const StoreWaitNotices notices(rank, host, opts.port, total);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    opts.timeout = std::max(std::chrono::milliseconds(1), std::min(left, kStoreTry));
    try {
      auto store = c10::make_intrusive<c10d::TCPStore>(host, opts);
      store->setTimeout(total);
      return store;
    } catch (const std::exception& e) {
      if (std::string(e.what()).find("timed out") == std::string::npos || std::chrono::steady_clock::now() >= deadline) {
        throw;
      }
    }
  }
}

c10::intrusive_ptr<c10d::Store> tcp_store(const std::string& host, int port, const InitOptions& options) {
  // Port 0: a world of one whose rank serves the store on any free loopback port.
  const bool any_port = port == 0 && options.world_size() == 1 && is_loopback(host) && host != "::1" &&
                        !store_served_by_launcher();
  SHARDOPT_CHECK((port > 0 || any_port) && port < 65536, "port ", port, " is outside (0, 65536)");
  c10d::TCPStoreOptions opts;
  // Under torchrun, or shardopt's own launcher, the launcher already serves the store at
  // MASTER_ADDR:MASTER_PORT (and says so): every rank connects to it as a client, as
  // torch.distributed does.
  opts.isServer = options.rank() == 0 && !store_served_by_launcher();
  opts.numWorkers = options.world_size();
  opts.waitWorkers = false;
  opts.timeout = setup_timeout(options);
  // A loopback rendezvous listens on loopback only: rank 0 binds the socket itself and hands it
  // to the store.
  // Any other host's store listens on every interface, binding the port itself (an fd of -1 given
  // to the store would be taken for a socket).
  if (opts.isServer) {
    const int fd = loopback_listen_fd(host, port, "rank 0");
    if (fd >= 0) opts.masterListenFd = fd;
  }
  opts.port = static_cast<uint16_t>(port);
  try {
    auto store = connect_store(host, opts, options.rank());
    if (!store_served_by_launcher()) return store;
    // The launcher's store outlives the workers: each attempt of a job torchrun restarts keeps its
    // keys (the group's addresses, heartbeats, agreements) apart, under torch.distributed's prefix.
    const char* attempt = env_var("TORCHELASTIC_RESTART_COUNT");
    return c10::make_intrusive<c10d::PrefixStore>(std::string("/worker/attempt_") + (attempt ? attempt : "0"), store);
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    SHARDOPT_CHECK(false, "rank ", options.rank(), " could not reach the store at ", host, ":", port, " within ",
                   setup_timeout(options).count(), " ms: ",
                   what.find("timed out") != std::string::npos
                       ? "nothing answered there (rank 0 serves it at MASTER_ADDR:MASTER_PORT: is that address "
                         "reachable from this host, and rank 0 started?)"
                       : what);
  } catch (const std::exception& e) {
    SHARDOPT_CHECK(false, "rank ", options.rank(), " could not reach the store at ", host, ":",
                port, " within ", setup_timeout(options).count(), " ms: ", e.what());
  }
}

}  // namespace

// Note [Several ranks in one process]
// c10d's FlightRecorder (a process-wide debugging ring buffer of recent collectives) updates a
// shared map without a lock when several Gloo groups of one process start collectives at once,
// and crashes. Ranks sharing a process are exactly that case, whatever the rendezvous (a caller's
// store, tcp://, file://), and so are a rank's own groups (its block, its replicas, its recovery
// group) when their collectives overlap; so the recorder is off unless the user configured it
// (TORCH_FR_BUFFER_SIZE). The variable is set when the library is loaded: the recorder reads it
// at its first use, and setenv while another thread reads the environment (two ranks' threads
// forming their groups) is itself a crash.
namespace {
const bool kFlightRecorderOff = [] {
  setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
  return true;
}();
}  // namespace

std::shared_ptr<ProcessGroup> init_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                 InitOptions options) {
  SHARDOPT_CHECK(store, "init_process_group got a null store");
  check_rank(options);
  resolve_backend(options.backend());
  if (options.backend() != "nccl") socket_interfaces();  // a name this host lacks fails here, before the rendezvous
  store->setTimeout(setup_timeout(options));
  return make_group(store, options, "");
}

std::shared_ptr<ProcessGroup> init_process_group(InitOptions options) {
  const std::string method = options.init_method();
  resolve_backend(options.backend());
  if (options.backend() != "nccl") socket_interfaces();  // a name this host lacks fails here, before the rendezvous
  if (method == "env://") {
    const LaunchEnv e = read_launch_env(/*need_master=*/true);
    if (options.rank() < 0) options.rank(e.rank);
    if (options.world_size() < 0) options.world_size(e.world_size);
    check_rank(options);
    auto store = tcp_store(e.master_addr, e.master_port, options);
    return make_group(store, options, e.master_addr, e.master_port);
  }
  if (method.rfind("tcp://", 0) == 0) {
    std::string rest = method.substr(6);
    auto colon = rest.rfind(':');
    SHARDOPT_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < rest.size(),
                "malformed init_method '", method, "' (expected tcp://HOST:PORT)");
    std::string host = rest.substr(0, colon);
    int port = parse_int(rest.substr(colon + 1), "the port of init_method '" + method + "'");
    rank_from_env(options);
    check_rank(options);
    return make_group(tcp_store(host, port, options), options, host, port);
  }
  if (method.rfind("file://", 0) == 0) {
    std::string path = method.substr(7);
    SHARDOPT_CHECK(!path.empty() && path[0] == '/', "malformed init_method '", method,
                "' (expected file:///ABSOLUTE/PATH)");
    rank_from_env(options);
    check_rank(options);
    auto store = c10::make_intrusive<c10d::FileStore>(path, options.world_size());
    store->setTimeout(setup_timeout(options));
    return make_group(store, options, "");
  }
  SHARDOPT_CHECK(false, "malformed init_method '", method,
              "' (expected \"env://\", \"tcp://HOST:PORT\" or \"file:///PATH\")");
}

bool store_served_by_launcher() {
  const char* v = env_var(kLauncherStoreVariable);
  return v && std::string(v) == "True";
}

c10::intrusive_ptr<c10d::Store> serve_store(const std::string& host, int& port, std::chrono::milliseconds timeout) {
  SHARDOPT_CHECK(port >= 0 && port < 65536, "port ", port, " is outside [0, 65536)");
  SHARDOPT_CHECK(port > 0 || (is_loopback(host) && host != "::1"), "port 0 (any free port) needs a loopback IPv4 host, got ",
                 host);
  c10d::TCPStoreOptions opts;
  opts.isServer = true;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  const int fd = loopback_listen_fd(host, port, "the launcher");
  if (fd >= 0) opts.masterListenFd = fd;  // as in tcp_store: another host's store binds its port itself
  opts.port = static_cast<uint16_t>(port);
  try {
    return c10::make_intrusive<c10d::TCPStore>(host, opts);
  } catch (const std::exception& e) {
    SHARDOPT_CHECK(false, "the launcher could not serve the rendezvous store at ", host, ":", port, ": ", e.what());
  }
}

namespace {
// Note [Closed rendezvous]: the mark a job under way leaves in its store.
constexpr const char* kRendezvousClosedKey = "shardopt/rendezvous/closed";
}  // namespace

void ProcessGroup::set_joining(int global_rank, c10::intrusive_ptr<c10d::Store> store) {
  joining_ = true;
  global_ranks_ = {global_rank};
  store_ = std::move(store);
}

void close_rendezvous(c10d::Store& store) { store.set(kRendezvousClosedKey, std::vector<uint8_t>{1}); }

bool rendezvous_closed(c10d::Store& store) { return store.check({kRendezvousClosedKey}); }

}  // namespace shardopt
