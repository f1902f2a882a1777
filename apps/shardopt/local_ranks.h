// `shardopt ... -n N` without a launcher: starts N copies of this executable as local ranks.
#pragma once

namespace shardopt::app {

// True when a launcher started this process as one rank (RANK, OMPI_COMM_WORLD_RANK, PMI_RANK
// or SLURM_PROCID is set).
bool under_a_launcher();

// Runs this executable's own command line `argv` as `n` local ranks on 127.0.0.1 (RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT set); they share the
// terminal. When one rank fails the others have 5 s to exit (each reports its own error), a rank
// that is reporting the failure up to 30 s, then are stopped (Note [The others' grace] in
// local_ranks.cpp). Returns 0 when every rank exits 0, else
// the first failing rank's exit code (128 + signal for a signal). With `survive_failures` a rank
// killed by a signal is left to the others (they go on without it, shardopt/resilience/resilient.h):
// it is reported, a replacement is started for it (once per rank, with SHARDOPT_REPLACEMENT=1) which
// the run admits after its next refresh, and the run succeeds when the ranks that exit by themselves
// exit 0; once one rank has finished, the others have 30 s to finish too.
int run_local_ranks(int n, char** argv, bool survive_failures = false);

}  // namespace shardopt::app
