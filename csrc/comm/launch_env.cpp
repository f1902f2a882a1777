// The launcher's variables: one table, one reader.
#include <shardopt/comm/launch_env.h>
#include <shardopt/check.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <optional>

namespace shardopt {

const std::vector<LaunchVariable> kLaunchVariables = {
    {"RANK", "this process's rank (tools/launch, torchrun, shardopt -n)"},
    {"WORLD_SIZE", "the number of ranks"},
    {"LOCAL_RANK", "the rank on this node; picks the CUDA device of an NCCL group"},
    {"LOCAL_WORLD_SIZE", "the ranks on this node"},
    {"OMPI_COMM_WORLD_RANK", "Open MPI: the rank"},
    {"OMPI_COMM_WORLD_SIZE", "Open MPI: the number of ranks"},
    {"OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI: the rank on this node"},
    {"OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI: the ranks on this node"},
    {"PMI_RANK", "PMI (MPICH, Intel MPI): the rank"},
    {"PMI_SIZE", "PMI: the number of ranks"},
    {"MPI_LOCALRANKID", "MPICH / Intel MPI: the rank on this node"},
    {"MPI_LOCALNRANKS", "MPICH / Intel MPI: the ranks on this node"},
    {"SLURM_PROCID", "SLURM: the rank"},
    {"SLURM_NTASKS", "SLURM: the number of ranks"},
    {"SLURM_LOCALID", "SLURM: the rank on this node"},
    {"SLURM_NTASKS_PER_NODE", "SLURM: the ranks on each node"},
    {"SLURM_JOB_NODELIST", "SLURM: the job's nodes; the first is the default MASTER_ADDR"},
    {"SLURM_NODELIST", "SLURM (older): the same"},
    {"SLURM_JOB_ID", "SLURM: the job id; the default MASTER_PORT is 29500 + SLURM_JOB_ID % 1000"},
    {"TORCHELASTIC_USE_AGENT_STORE", "True when the launcher serves the store (torchrun's agent, `shardopt train -n N`); every rank then connects as a client"},
    {"MASTER_ADDR", "the host of the rendezvous store (rank 0 serves it); wins over the defaults"},
    {"MASTER_PORT", "its port; wins over the default 29500"},
    {"GLOO_SOCKET_IFNAME", "the network interfaces a Gloo group talks over, comma-separated (eth0 or eth0,eth1); "
                           "wins over the address MASTER_ADDR implies"},
    {"SHARDOPT_CHECK_DESYNC", "1: check every collective's sequence number and kind across ranks"},
    {"SHARDOPT_FUSED_KERNELS", "default|avx2|avx512: caps the fused step's instruction set"},
    {"SHARDOPT_ANNOUNCE_VERSION", "replaces the shardopt version a rank announces at join (tests the refusal)"},
    {"SHARDOPT_ANNOUNCE_TORCH_VERSION", "replaces the LibTorch version a rank announces at join and a replacement "
                                        "announces to the job it joins (tests the refusal)"},
    {"TORCHELASTIC_RESTART_COUNT", "torchrun: how many times the agent has restarted the workers; `shardopt train` "
                                   "then resumes from --checkpoint-dir by itself"},
    {"SHARDOPT_FAULT_AT_STEP", "R:S: `shardopt train`'s rank R kills itself (SIGKILL) before step S, in a run not "
                               "yet restarted (tests of restarts)"},
    {"SHARDOPT_AWAIT_JOINER_AT_STEP", "S: `shardopt train --survive-failures` waits (within --timeout) before its "
                                      "refresh at step S until a replacement has asked to join, so that it is "
                                      "admitted there (tests of a replacement joining)"},
    {"SHARDOPT_FAULT_IN_PHASE", "R:TEXT[:N][;...]: the process with RANK R kills itself (SIGKILL) the N-th time it "
                                "enters a phase whose name contains TEXT (tests of surviving a dead rank)"},
    {"SHARDOPT_REPLACEMENT", "1: set by `shardopt train -n N --survive-failures` on a process it starts to replace a "
                             "killed rank; the fault injections above are off in it"},
    {"TORCH_FR_BUFFER_SIZE", "c10d's flight recorder; shardopt sets 0 unless given"},
    {"TORCH_NCCL_NONBLOCKING_TIMEOUT", "c10d: seconds an NCCL communicator may take to form; shardopt sets the "
                                       "group's timeout unless given"},
};

const char* env_var(const char* name) {
  const bool listed = std::any_of(kLaunchVariables.begin(), kLaunchVariables.end(),
                                  [&](const LaunchVariable& v) { return std::strcmp(v.name, name) == 0; });
  TORCH_INTERNAL_ASSERT(listed, "environment variable ", name, " is read but not listed in kLaunchVariables");
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

namespace {

struct Convention {
  const char* name;
  const char *rank, *size, *local_rank, *local_size;
};

constexpr Convention kConventions[] = {
    {"RANK/WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"SLURM", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
};

std::optional<int> env_int(const char* name) {
  const char* v = env_var(name);
  if (!v) return std::nullopt;
  // SLURM_NTASKS_PER_NODE may read "4(x2)": the count before the repetition.
  std::string text(v);
  if (std::string(name) == "SLURM_NTASKS_PER_NODE") text = text.substr(0, text.find('('));
  size_t pos = 0;
  int value = -1;
  try {
    value = std::stoi(text, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  SHARDOPT_CHECK(pos == text.size() && pos > 0, name, " must be an integer, got '", v, "'");
  SHARDOPT_CHECK(value >= 0, name, " must not be negative, got ", value);
  return value;
}

// A value given by several conventions must agree.
void check_same(const char* what, const Convention& chosen, const char* Convention::*field, int value) {
  for (const auto& c : kConventions) {
    if (&c == &chosen) continue;
    const auto other = env_int(c.*field);
    SHARDOPT_CHECK(!other || *other == value, "contradictory launcher variables: ", chosen.*field, "=", value,
                   " but ", c.*field, "=", *other, " (", what, ")");
  }
}

}  // namespace

bool ranks_span_nodes() {
  const bool launched = std::any_of(std::begin(kConventions), std::end(kConventions),
                                    [](const Convention& c) { return env_var(c.rank) && env_var(c.size); });
  if (!launched) return false;  // one process, no launcher
  const LaunchEnv e = read_launch_env(/*need_master=*/false);
  return e.local_world_size > 0 && e.world_size > e.local_world_size;
}

std::string first_slurm_host(const std::string& nodelist) {
  const auto bracket = nodelist.find('[');
  const auto comma = nodelist.find(',');
  if (bracket == std::string::npos || (comma != std::string::npos && comma < bracket)) {
    return nodelist.substr(0, comma);
  }
  const std::string prefix = nodelist.substr(0, bracket);
  const auto end = nodelist.find_first_of(",-]", bracket + 1);
  SHARDOPT_CHECK(end != std::string::npos, "malformed SLURM node list '", nodelist, "'");
  return prefix + nodelist.substr(bracket + 1, end - bracket - 1);
}

LaunchEnv read_launch_env(bool need_master) {
  LaunchEnv e;
  const Convention* chosen = nullptr;
  for (const auto& c : kConventions) {
    if (env_var(c.rank) && env_var(c.size)) {
      chosen = &c;
      break;
    }
  }
  SHARDOPT_CHECK(chosen, "no launcher variables: set RANK and WORLD_SIZE (or run under tools/launch, torchrun, "
                 "mpirun or srun, whose OMPI_COMM_WORLD_*, PMI_* or SLURM_* variables are read too)");
  e.convention = chosen->name;
  e.variables = {chosen->rank, chosen->size, chosen->local_rank, chosen->local_size};
  e.rank = *env_int(chosen->rank);
  e.world_size = *env_int(chosen->size);
  SHARDOPT_CHECK(e.world_size >= 1, chosen->size, " must be at least 1, got ", e.world_size);
  SHARDOPT_CHECK(e.rank < e.world_size, chosen->rank, "=", e.rank, " is outside [0, ", chosen->size, "=",
                 e.world_size, ")");
  check_same("the rank", *chosen, &Convention::rank, e.rank);
  check_same("the world size", *chosen, &Convention::size, e.world_size);
  for (const auto& c : kConventions) {  // the local rank: the chosen convention's, else any given
    if (e.local_rank < 0 && (&c == chosen || !env_var(chosen->local_rank))) {
      if (auto v = env_int(c.local_rank)) e.local_rank = *v;
    }
    if (e.local_world_size < 0 && (&c == chosen || !env_var(chosen->local_size))) {
      if (auto v = env_int(c.local_size)) e.local_world_size = *v;
    }
  }
  if (!need_master) return e;

  if (const char* addr = env_var("MASTER_ADDR")) {
    e.master_addr = addr;
  } else if (const char* nodes = env_var("SLURM_JOB_NODELIST") ? env_var("SLURM_JOB_NODELIST") : env_var("SLURM_NODELIST")) {
    e.master_addr = first_slurm_host(nodes);
  } else {
    SHARDOPT_CHECK(e.local_world_size == e.world_size, "MASTER_ADDR is not set and the ranks are not all on this "
                   "node (local world size ", e.local_world_size, " of ", e.world_size,
                   "): export MASTER_ADDR=<host of rank 0>");
    e.master_addr = "127.0.0.1";
  }
  if (auto port = env_int("MASTER_PORT")) {
    e.master_port = *port;
  } else {
    const auto job = env_int("SLURM_JOB_ID");
    e.master_port = 29500 + (job ? *job % 1000 : 0);
  }
  // Port 0 (any free port, bound by the one rank itself) only where no other rank must find it.
  SHARDOPT_CHECK((e.master_port > 0 || (e.master_port == 0 && e.world_size == 1)) && e.master_port < 65536,
                 "MASTER_PORT ", e.master_port, " is outside (0, 65536)");
  return e;
}

}  // namespace shardopt
