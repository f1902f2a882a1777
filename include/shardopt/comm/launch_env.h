// What a launcher tells a rank: its rank, the world size, its place on the node and where the
// rendezvous store is. One table of the variables read (kLaunchVariables), one reader.
//
// Conventions, in this order (the first whose rank and size are both set wins):
//   RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE          tools/launch, torchrun, shardopt -n
//   OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE   Open MPI's mpirun
//   PMI_RANK / PMI_SIZE, MPI_LOCALRANKID / MPI_LOCALNRANKS     MPICH and Intel MPI (PMI)
//   SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID                srun
// MASTER_ADDR and MASTER_PORT take precedence when set. Otherwise the address is the first host
// of SLURM_JOB_NODELIST (or SLURM_NODELIST) under SLURM, 127.0.0.1 when every rank is on this
// node (local world size = world size), and an error naming MASTER_ADDR elsewhere; the port is
// 29500 (+ SLURM_JOB_ID % 1000 under SLURM, so that jobs sharing a node differ). Two conventions
// that are both set and disagree are an error naming both variables.
#pragma once

#include <string>
#include <vector>

namespace shardopt {

struct LaunchVariable {
  const char* name;
  const char* meaning;
};
// Every environment variable shardopt reads, with its meaning.
extern const std::vector<LaunchVariable> kLaunchVariables;

// The value of environment variable `name`, or null when it is unset or empty. The one reader of
// the environment: `name` must be in kLaunchVariables (an internal error otherwise).
const char* env_var(const char* name);

struct LaunchEnv {
  int rank = -1, world_size = -1;
  int local_rank = -1, local_world_size = -1;  // -1: not given
  std::string master_addr;
  int master_port = 0;
  std::string convention;  // which launcher's variables gave the rank ("RANK/WORLD_SIZE", "Open MPI", ...)
  std::vector<std::string> variables;  // that convention's: rank, world size, local rank, local world size
};

// Reads the launcher's variables. `need_master`: also the rendezvous address and port (env://).
// Missing, malformed or contradictory variables are errors naming them.
LaunchEnv read_launch_env(bool need_master = true);

// Whether the launcher says the ranks span several nodes: it gives a local world size (the ranks
// on this node) smaller than the world size. False where it gives none, or every rank is here.
bool ranks_span_nodes();

// The first host of a SLURM node list: "node[03-05,9],gpu1" -> "node03".
std::string first_slurm_host(const std::string& nodelist);

}  // namespace shardopt
