"""Real processes started the way each launcher starts them (the variables are what matters;
mpirun and srun themselves need not be installed), ranks refused at join, and ranks killed with
SIGKILL in each phase of training: the survivors' errors name the dead rank, the collective and
the phase, within the bound.

Run by ctest as two tests that name their cases (tests/CMakeLists.txt: the timed ones run alone);
a new case is named in one of them. MP_WORKER names tests/mp_worker.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

WORKER = os.environ["MP_WORKER"]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
               "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NODELIST",
               "SLURM_NODELIST", "SLURM_JOB_ID", "SHARDOPT_ANNOUNCE_VERSION",
               "SHARDOPT_ANNOUNCE_TORCH_VERSION", "GLOO_SOCKET_IFNAME")


RESERVED = []  # sockets that keep this test's ports until it exits


def free_port(low=None, high=None):
    """A port on 127.0.0.1 (in [low, high) when given) kept for this test process: a socket bound
    to it with SO_REUSEADDR, not listening, stays open, so no other process gets it, and rank 0's
    store (which binds it with SO_REUSEADDR too) still can."""
    for port in range(low, high) if low else [0]:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        RESERVED.append(s)
        return s.getsockname()[1]
    raise RuntimeError("no free port")


def base_env():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["SHARDOPT_TEST_TIMEOUT_S"] = "20"
    return env


def start(envs, *args):
    return [subprocess.Popen([WORKER, *args], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for e in envs]


def finish(procs, timeout=90):
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        outs.append((p.returncode, out))
    return outs


class LaunchEnvironments(unittest.TestCase):
    def hello(self, per_rank):
        envs = []
        for r in range(2):
            e = base_env()
            e.update(per_rank(r))
            envs.append(e)
        outs = finish(start(envs, "hello"))
        for r, (code, out) in enumerate(outs):
            self.assertEqual(code, 0, out)
            self.assertIn(f"rank {r} of 2, local rank {r}: sum of ranks 1", out)

    def test_open_mpi_without_master_variables(self):
        port = str(free_port())
        self.hello(lambda r: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2",
                              "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                              "MASTER_PORT": port})

    def test_pmi(self):
        port = str(free_port())
        self.hello(lambda r: {"PMI_RANK": str(r), "PMI_SIZE": "2", "MPI_LOCALRANKID": str(r),
                              "MPI_LOCALNRANKS": "2", "MASTER_PORT": port})

    def test_slurm_address_from_the_node_list_and_port_from_the_job_id(self):
        job = free_port(29500, 30500) - 29500
        self.hello(lambda r: {"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
                              "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost,node[2-4]",
                              "SLURM_JOB_ID": str(job)})

    def test_master_variables_take_precedence(self):
        port = str(free_port())
        self.hello(lambda r: {"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
                              "SLURM_JOB_NODELIST": "no-such-host[1-2]", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": port})

    def test_missing_or_contradictory_variables_are_one_line_naming_them(self):
        cases = [({}, "set RANK and WORLD_SIZE"),
                 ({"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
                  "contradictory launcher variables: RANK=0 but OMPI_COMM_WORLD_RANK=1"),
                 ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"},
                  "MASTER_ADDR is not set and the ranks are not all on this node"),
                 ({"RANK": "0", "WORLD_SIZE": "two", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
                  "WORLD_SIZE must be an integer, got 'two'"),
                 # Port 0 (any free port) is for a world of one: the other ranks could not find it.
                 ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"},
                  "MASTER_PORT 0 is outside (0, 65536)")]
        for extra, needle in cases:
            e = base_env()
            e.update(extra)
            (code, out), = finish(start([e], "hello"))
            self.assertNotEqual(code, 0, extra)
            lines = [l for l in out.splitlines() if l.strip()]
            self.assertEqual(len(lines), 1, out)
            self.assertIn(needle, lines[0])

    def test_gloo_socket_ifname_picks_the_interfaces(self):
        for interfaces in ("lo", "lo,lo"):
            port = str(free_port())
            self.hello(lambda r: {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": interfaces})

    def test_a_store_on_every_interface_and_the_ranks_on_the_one_named(self):
        # 0.0.0.0 is no loopback address: rank 0's store listens on every interface, as on a
        # cluster, and the peers reach it through loopback.
        port = str(free_port())
        self.hello(lambda r: {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                              "MASTER_ADDR": "0.0.0.0", "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": "lo"})

    def test_an_interface_that_is_not_there_is_one_line_on_every_rank(self):
        port = str(free_port())
        envs = []
        for r in range(2):
            e = base_env()
            e.update({"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                      "GLOO_SOCKET_IFNAME": "lo,nosuchif0"})
            envs.append(e)
        for code, out in finish(start(envs, "hello")):
            self.assertNotEqual(code, 0, out)
            lines = [l for l in out.splitlines() if l.strip()]
            self.assertEqual(len(lines), 1, out)
            self.assertIn("GLOO_SOCKET_IFNAME: no interface 'nosuchif0' on this host", lines[0])

    def refused_at_join(self, variable, value, field):
        """Rank 1 announces `value` through `variable`: both ranks fail naming `field` and it."""
        port = str(free_port())
        envs = []
        for r in range(2):
            e = base_env()
            e.update({"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
            if r == 1:
                e[variable] = value
            envs.append(e)
        for r, (code, out) in enumerate(finish(start(envs, "hello"))):
            self.assertNotEqual(code, 0, out)
            self.assertIn(field, out)
            self.assertIn(value, out)
            self.assertNotIn("sum of ranks", out)

    def test_a_rank_of_another_libtorch_version_is_refused_naming_both(self):
        self.refused_at_join("SHARDOPT_ANNOUNCE_TORCH_VERSION", "2.10.0", "LibTorch version")

    def test_a_rank_of_another_version_is_refused_naming_both(self):
        self.refused_at_join("SHARDOPT_ANNOUNCE_VERSION", "0.3.9", "shardopt version")


def listening_addresses(port):
    """The local addresses of sockets listening on `port` (from /proc/net/tcp and tcp6)."""
    found = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            host, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.append(host)
    return found


class LoopbackStore(unittest.TestCase):
    def test_a_loopback_rendezvous_listens_on_loopback_only(self):
        port = free_port()
        e = base_env()
        e.update({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                  "SHARDOPT_TEST_TIMEOUT_S": "10"})
        p = subprocess.Popen([WORKER, "hello"], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 10
            addresses = []
            while not addresses and time.monotonic() < deadline and p.poll() is None:
                addresses = listening_addresses(port)
                time.sleep(0.05)
            self.assertEqual(addresses, ["0100007F"], "the store must listen on 127.0.0.1 only")
        finally:
            p.kill()
            p.wait()


    def test_the_launchers_store_listens_on_loopback_only(self):
        # tools/launch's rendezvous (its store, whichever process serves it) for ranks on this
        # machine: every socket listening on its port is bound to 127.0.0.1.
        port = free_port()
        launch = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "launch")
        p = subprocess.Popen([sys.executable, launch, "-n", "2", "--port", str(port), WORKER, "hold"], env=base_env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 30
            addresses = []
            while not addresses and time.monotonic() < deadline and p.poll() is None:
                addresses = listening_addresses(port)
                time.sleep(0.05)
            self.assertTrue(addresses, "nothing listened on the launcher's port")
            self.assertEqual(set(addresses), {"0100007F"}, "the launcher's store must listen on 127.0.0.1 only")
        finally:
            p.terminate()
            p.communicate(timeout=60)


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def tcp_sockets_of(pid):
    """(state, local address) of every TCP socket process `pid` holds (its fds against
    /proc/net/tcp and tcp6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            m = re.match(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    found = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(name).read().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                found.append((fields[3], fields[1].split(":")[0]))
    return found


def loopback_envs(port, world=2):
    """Each rank's environment for an env:// rendezvous on 127.0.0.1:`port`."""
    envs = []
    for r in range(world):
        e = base_env()
        e.update({"RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        envs.append(e)
    return envs


class UnreachableStore(unittest.TestCase):
    def test_a_rank_says_every_30_s_which_address_it_waits_for_then_fails_in_one_line(self):
        # MASTER_ADDR names an address nothing answers at (TEST-NET-1, reserved for documentation):
        # rank 1 says at 30 s that it is still waiting for the store there, and fails at its 35 s
        # setup timeout in one line naming the address; nothing else is printed (no c10d log of
        # each try, no backtrace).
        port = free_port()
        env = base_env()
        env.update({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": str(port),
                    "SHARDOPT_TEST_TIMEOUT_S": "35"})
        t0 = time.monotonic()
        p = subprocess.run([WORKER, "hello"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=120)
        elapsed = time.monotonic() - t0
        self.assertNotEqual(p.returncode, 0, p.stderr)
        lines = [l for l in p.stderr.splitlines() if l.strip()]
        self.assertEqual(len(lines), 2, p.stderr)
        self.assertIn(f"rank 1 has waited 30 s for the store at 192.0.2.1:{port} (MASTER_ADDR, MASTER_PORT); still "
                      "trying, until the setup timeout of 35 s", lines[0])
        self.assertIn(f"rank 1 could not reach the store at 192.0.2.1:{port} within 35000 ms: nothing answered there",
                      lines[1])
        self.assertGreaterEqual(elapsed, 35)
        self.assertLess(elapsed, 35 + 15)  # a try of at most 5 s past the timeout, and start-up


def private_mounts_usable():
    """Whether a process may get a mount namespace of its own (root, util-linux's unshare)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode == 0


class UnsharedFolder(unittest.TestCase):
    """A sharded checkpoint's folder that is not shared: each rank mounts a folder of its own at
    the same path (as two nodes with node-local disks would have), so neither sees the other's
    part. The save must fail on every rank naming the parts it misses, with no main file written,
    instead of "succeeding" and failing at the load."""

    def setUp(self):
        if not private_mounts_usable():
            self.skipTest("needs root and mount namespaces")
        self.dir = tempfile.mkdtemp(prefix="shardopt-unshared-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def save(self, how):
        port = free_port()
        envs = loopback_envs(port)
        path = os.path.join(self.dir, "run.ckpt")
        procs = [subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                   f'mount -t tmpfs tmpfs "{self.dir}" && exec "$0" "$@"', WORKER, "one_sharded_save",
                                   path, how], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for e in envs]
        return finish(procs), path

    def check(self, how):
        outs, path = self.save(how)
        for r, (code, out) in enumerate(outs):
            self.assertNotEqual(code, 0, out)
            self.assertNotIn("saved", out)
            lines = [l for l in out.splitlines() if l.strip()]
            self.assertEqual(len(lines), 1, out)
            self.assertIn("a sharded checkpoint's folder must be one every rank sees", lines[0])
            other = 1 - r if how == "sync" else 1  # (in the background, rank 0's view: rank 1's part)
            self.assertIn(f"run.ckpt.optim-{other}-of-2.", lines[0])
        self.assertEqual(os.listdir(self.dir), [], "nothing is written outside the ranks' own folders")

    def test_a_save_fails_on_every_rank_naming_the_parts_it_cannot_see(self):
        self.check("sync")

    def test_a_background_save_fails_on_every_rank_naming_them_too(self):
        self.check("async")


class Loopback(unittest.TestCase):
    def hold(self, envs):
        """Ranks that hold their group open (after one all-reduce) until this test ends; each must
        then exit 0."""
        procs = [subprocess.Popen([WORKER, "hold"], env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for e in envs]

        def release():
            for p in procs:
                p.stdin.close()
            for r, p in enumerate(procs):
                self.assertEqual(p.wait(timeout=60), 0, f"holding rank {r}")
        self.addCleanup(release)
        for r, p in enumerate(procs):
            self.assertEqual(p.stdout.readline().strip(), f"holding on rank {r}")
        return procs

    def test_nothing_a_loopback_group_holds_listens_beyond_this_machine(self):
        # Every TCP socket of each rank holding its group, the store's, Gloo's listening sockets
        # and its connections, is on loopback.
        for r, p in enumerate(self.hold(loopback_envs(free_port()))):
            sockets = tcp_sockets_of(p.pid)
            self.assertTrue(any(state == "0A" for state, _ in sockets), f"rank {r}: no listening socket seen")
            for state, address in sockets:
                self.assertIn(address, LOOPBACK, f"rank {r}: a socket in state {state} on {address}")

    def test_a_second_job_on_the_same_port_fails_at_once_naming_it(self):
        # Job A's two ranks hold their group on a port; job B is started on the same port. B's
        # rank 0 cannot serve the store there, and B's rank 1, which reaches A's store, is told
        # its rank is taken there: each fails in one line naming the port, long before the 20 s
        # timeout, and A is left alone.
        port = free_port()
        job_a = self.hold(loopback_envs(port))
        t0 = time.monotonic()
        job_b = finish(start(loopback_envs(port), "hello"))
        elapsed = time.monotonic() - t0
        for r, (code, out) in enumerate(job_b):
            self.assertNotEqual(code, 0, out)
            lines = [l for l in out.splitlines() if l.strip()]
            self.assertEqual(len(lines), 1, out)
            self.assertIn(f"127.0.0.1:{port}", lines[0])
        self.assertIn("cannot listen on", job_b[0][1])
        self.assertIn("another job's rendezvous is at", job_b[1][1])
        self.assertLess(elapsed, 10)
        for p in job_a:
            self.assertIsNone(p.poll(), "job A still runs")

LAUNCH_HOSTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools",
                            "launch_hosts")


def network_namespaces_usable():
    """Whether this process may make network namespaces (root, iproute2, a kernel that allows it)."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    probe = f"soprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return False
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True


def run_hosts(*args):
    """tools/launch_hosts with `args`: its exit code, output, errors, and the namespaces of its
    hosts still listed after it exited."""
    p = subprocess.Popen([sys.executable, LAUNCH_HOSTS, *args], env=base_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=180)
    prefix = f"so{p.pid % 100000}"
    left = [line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                       text=True).stdout.splitlines()
            if re.match(prefix + r"(h\d+|sw)\b", line)]
    return p.returncode, out, err, left


class Hosts(unittest.TestCase):
    """tools/launch_hosts: each rank in a network namespace of its own, so the ranks can reach one
    another only across the bridge: the store on rank 0's address and Gloo on GLOO_SOCKET_IFNAME."""

    def setUp(self):
        if not network_namespaces_usable():
            self.skipTest("needs root, iproute2 and network namespaces")

    def test_ranks_on_three_hosts_over_shaped_links(self):
        code, out, err, left = run_hosts("-n", "3", "--rate", "1gbit", "--timeout", "120", WORKER, "hello")
        self.assertEqual(code, 0, out + err)
        for r in range(3):
            self.assertIn(f"[rank {r}] rank {r} of 3, local rank 0: sum of ranks 3", out)
        self.assertEqual(left, [], "the hosts must be removed")

    def test_an_interface_without_an_address_is_one_line(self):
        ns = f"soaddr{os.getpid()}"
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        try:
            subprocess.run(["ip", "-n", ns, "link", "add", "d0", "type", "veth", "peer", "name", "d1"], check=True,
                           capture_output=True)
            subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, capture_output=True)
            e = base_env()
            e.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                      "GLOO_SOCKET_IFNAME": "d0"})
            out = subprocess.run(["ip", "netns", "exec", ns, WORKER, "hello"], env=e, capture_output=True, text=True,
                                 timeout=60)
        finally:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.assertNotEqual(out.returncode, 0, out.stdout + out.stderr)
        lines = [l for l in (out.stdout + out.stderr).splitlines() if l.strip()]
        self.assertEqual(len(lines), 1, out.stdout + out.stderr)
        self.assertIn("GLOO_SOCKET_IFNAME: interface 'd0' has no IP address", lines[0])

    def test_a_rank_that_fails_is_named_and_the_hosts_removed(self):
        code, out, err, left = run_hosts("-n", "2", "--timeout", "120", WORKER, "no_such_case")
        self.assertEqual(code, 1, out + err)
        self.assertRegex(err, r"launch_hosts: rank [01] exited with \d+; stopped the others")
        self.assertEqual(left, [], "the hosts must be removed")


class RankDeath(unittest.TestCase):
    """No launcher in between: the survivors are left to the library."""

    def run_phase(self, phase, victim=1, world=2):
        port = str(free_port())
        envs = []
        for r in range(world):
            e = base_env()
            e.update({"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                      "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
            envs.append(e)
        t0 = time.monotonic()
        procs = start(envs, "die_in", phase, str(victim))
        outs = finish(procs)
        elapsed = time.monotonic() - t0
        self.assertEqual(outs[victim][0], -signal.SIGKILL, outs[victim][1])
        for r, (code, out) in enumerate(outs):
            if r == victim:
                continue
            self.assertEqual(code, 1, out)
            return out, elapsed

    def test_forward_backward_step_and_consolidation(self):
        phases = {"forward": "forward (trainability check)", "backward": "backward (gradient reductions)",
                  "step": "step (parameter sync)", "consolidation": "consolidating the optimizer state"}
        for phase, named in phases.items():
            out, elapsed = self.run_phase(phase)
            # (Killed on this machine: named gone at once, with the reason.)
            self.assertIn("rank 1 stopped answering (its process on this machine exited)", out, phase)
            self.assertIn(named, out, phase)
            # The failed operation as the group names it: "<collective> #<n> (<phase>) ... on rank 0
            # failed or timed out", not any mention of a collective.
            self.assertRegex(out, r"\b(allreduce|reduce|broadcast|recv|send|allgather|reduce_scatter) #\d+ \("
                                  r"[^\n]* on rank 0 failed or timed out", phase)
            # The group timeout is 20 s; the death is seen when the connections close.
            self.assertLess(elapsed, 20 + 10, f"{phase}: {elapsed:.1f} s")

    def test_through_the_launcher_leaving_survivors_to_the_library(self):
        launch = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "launch")
        e = base_env()
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, launch, "-n", "3", "--keep-going", WORKER, "die_in", "backward", "2"],
                           env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        elapsed = time.monotonic() - t0
        self.assertNotEqual(p.returncode, 0)
        for r in (0, 1):
            self.assertRegex(p.stdout, rf"\[rank {r}\] shardopt: .*rank 2 stopped answering")
            self.assertIn(f"launch: rank {r} exited with code 1", p.stdout)
        self.assertIn("launch: rank 2 was killed by signal 9", p.stdout)
        self.assertLess(elapsed, 20 + 10)

    def test_rank_0_killed_under_the_launcher_is_named(self):
        # tools/launch serves the store apart from the ranks, with shardopt-store or, without it,
        # PyTorch's TCPStore: started on a Python without torch (here `-S`: no site packages), it
        # restarts itself under $SHARDOPT_PYTHON, else the set-up's virtual environment (found
        # through $SHARDOPT_CACHE). Either way rank 0's death leaves the store up, and the others
        # name rank 0. Where it finds neither, the store is rank 0's, and goes with it.
        launch = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "launch")
        self.assertTrue(os.environ.get("SHARDOPT_STORE"), "ctest names the shardopt-store it built")
        python = os.environ["SHARDOPT_PYTHON"]
        self.assertNotEqual(os.path.abspath(python), os.path.abspath(sys.executable),
                            "the launcher restarts under another interpreter than its own")
        no_cache = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, no_cache)
        # the project's virtual environment, where a set-up would have put it under no_cache
        os.symlink(os.path.dirname(os.path.dirname(os.path.abspath(python))),
                   os.path.join(no_cache, "venv-torch-" + os.environ.get("SHARDOPT_TORCH_VERSION", "2.11.0")))
        cases = {"shardopt-store": {},
                 "torch under $SHARDOPT_PYTHON": {"SHARDOPT_CACHE": tempfile.mkdtemp(dir=no_cache)},
                 "torch under the virtual environment": {"SHARDOPT_PYTHON": None, "SHARDOPT_CACHE": no_cache},
                 "rank 0's store": {"SHARDOPT_PYTHON": None, "SHARDOPT_CACHE": tempfile.mkdtemp(dir=no_cache)}}
        for server, changes in cases.items():
            with self.subTest(server=server):
                e = base_env()
                if server != "shardopt-store":
                    e.pop("SHARDOPT_STORE")
                for k, v in changes.items():
                    if v is None:
                        e.pop(k, None)
                    else:
                        e[k] = v
                p = subprocess.run([sys.executable, "-S", launch, "-n", "3", "--keep-going", WORKER, "die_in", "backward",
                                    "0"], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
                self.assertNotEqual(p.returncode, 0)
                for r in (1, 2):
                    if server == "rank 0's store":
                        self.assertIn(f"[rank {r}] shardopt: ", p.stdout)
                        self.assertIn("rank 0 (which serves the rendezvous store) cannot be reached", p.stdout)
                    else:
                        self.assertRegex(p.stdout, rf"\[rank {r}\] shardopt: .*rank 0 stopped answering")
                    self.assertIn(f"launch: rank {r} exited with code 1", p.stdout)
                self.assertIn("launch: rank 0 was killed by signal 9", p.stdout)
                if server != "rank 0's store":
                    self.assertNotIn("cannot be reached", p.stdout)

    def test_the_store_host_killed(self):
        out, elapsed = self.run_phase("step", victim=0)
        self.assertIn("rank 0 (which serves the rendezvous store) cannot be reached", out)
        self.assertLess(elapsed, 20 + 10)


class Launcher(unittest.TestCase):
    """tools/launch itself: a failing rank is one line, and stopping the launcher stops the ranks."""

    LAUNCH = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "launch")

    def test_a_rank_that_fails_at_once_is_one_line_every_time(self):
        # The ranks exit while the launcher is stopping the others: no traceback, ever.
        for attempt in range(10):
            p = subprocess.run([sys.executable, self.LAUNCH, "-n", "3", sys.executable, "-c", "import sys; sys.exit(3)"],
                               env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=60)
            self.assertEqual(p.returncode, 1, p.stdout)
            self.assertNotIn("Traceback", p.stdout, f"attempt {attempt}")
            self.assertRegex(p.stdout, r"launch: rank \d exited with code 3; stopped the other ranks")

    def test_each_rank_gets_its_share_of_the_cores_unless_omp_num_threads_is_set(self):
        # OMP_NUM_THREADS (LibTorch's intra-op team) = cores // N, at least 1, as torchrun keeps
        # ranks from spinning in each other's way; a value the user set is left as it is.
        show = [sys.executable, "-c", "import os; print('threads', os.environ.get('OMP_NUM_THREADS'))"]
        cores = len(os.sched_getaffinity(0))
        for n, preset, want in ((2, None, max(1, cores // 2)), (3 * cores, None, 1), (2, "3", 3)):
            env = base_env()
            env.pop("OMP_NUM_THREADS", None)
            if preset:
                env["OMP_NUM_THREADS"] = preset
            p = subprocess.run([sys.executable, self.LAUNCH, "-n", str(n), *show], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=60)
            self.assertEqual(p.returncode, 0, p.stdout)
            self.assertEqual(re.findall(r"threads (\S+)", p.stdout), [str(want)] * n, p.stdout)

    def test_a_stopped_or_deaf_rank_is_ended_after_a_grace_period(self):
        # Rank 0 fails; rank 1 ignores SIGTERM, rank 2 has stopped itself (SIGSTOP): the launcher
        # continues and terminates rank 2, kills rank 1 10 s after SIGTERM, and exits non-zero.
        code = ("import os, signal, sys, time\n"
                "r = int(os.environ['RANK'])\n"
                "print(os.getpid(), flush=True)\n"
                "if r == 1: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "if r == 2: os.kill(os.getpid(), signal.SIGSTOP)\n"
                "if r == 0: time.sleep(2); sys.exit(3)\n"
                "time.sleep(600)\n")
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, self.LAUNCH, "-n", "3", sys.executable, "-c", code], env=base_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = p.communicate(timeout=90)
        elapsed = time.monotonic() - t0
        self.assertEqual(p.returncode, 1, out)
        self.assertIn("launch: rank 0 exited with code 3; stopped the other ranks", out)
        self.assertIn("launch: rank 1 did not stop within 10 s of SIGTERM; killed it", out)
        self.assertNotIn("rank 2 did not stop", out)
        self.assertLess(elapsed, 60, out)
        for rank, pid in enumerate(int(x) for x in re.findall(r"\[rank \d\] (\d+)", out)):
            with self.assertRaises(ProcessLookupError, msg=f"rank {rank} (pid {pid}) still runs"):
                os.kill(pid, 0)

    def test_a_rank_that_aborts_keeps_its_last_line(self):
        # The launcher line-buffers its ranks' C stdio (coreutils' stdbuf preload): a line printed
        # just before an abort reaches the output, where a pipe's block buffer would have lost it.
        if not any(os.path.exists(lib) for lib in ("/usr/libexec/coreutils/libstdbuf.so",
                                                    "/usr/lib/coreutils/libstdbuf.so")):
            self.skipTest("coreutils' stdbuf preload library is not installed")
        p = subprocess.run([sys.executable, self.LAUNCH, "-n", "1", os.environ["MP_WORKER"], "abort_after_a_line"],
                           env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
        self.assertNotEqual(p.returncode, 0, p.stdout)
        self.assertIn("[rank 0] the last line before the abort", p.stdout)

    def test_timeout_bounds_a_keep_going_run(self):
        # Two ranks that would sleep for 10 minutes, under --keep-going (which leaves ranks to their
        # own errors): --timeout 3 still stops both at 3 s, and the run exits non-zero saying so.
        code = "import time\ntime.sleep(600)\n"
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, self.LAUNCH, "-n", "2", "--keep-going", "--timeout", "3", sys.executable,
                            "-c", code], env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=90)
        elapsed = time.monotonic() - t0
        self.assertNotEqual(p.returncode, 0, p.stdout)
        self.assertIn("the run exceeded --timeout 3", p.stdout)
        self.assertGreaterEqual(elapsed, 3, p.stdout)
        self.assertLess(elapsed, 40, p.stdout)

    def test_a_rank_reporting_the_failure_gets_until_30_s_after_it(self):
        # Rank 0 fails at about 3 s. Rank 1 has said in the store that it saw a failure (its
        # failure key, as a rank in its roll call does) and needs 12 s more to finish: it is not
        # stopped at the 5 s grace, and ends by itself. Rank 2, silent, is stopped at the 5 s grace.
        python = os.environ["SHARDOPT_PYTHON"]  # the project's Python: rank 1 writes to the store
        code = ("import os, sys, time\n"
                "r = int(os.environ['RANK'])\n"
                "if r == 0: time.sleep(3); sys.exit(3)\n"
                "if r == 1:\n"
                "    from torch.distributed import TCPStore\n"
                "    store = TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False)\n"
                "    store.set('/worker/attempt_0/shardopt/failed/1', 'seen')\n"
                "    print('reporting', flush=True); time.sleep(12); print('reported', flush=True); sys.exit(1)\n"
                "time.sleep(600)\n")
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, self.LAUNCH, "-n", "3", python, "-c", code], env=base_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=90)
        elapsed = time.monotonic() - t0
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertIn("launch: rank 0 exited with code 3; stopped the other ranks", p.stdout)
        self.assertIn("[rank 1] reporting", p.stdout)
        self.assertIn("[rank 1] reported", p.stdout)  # not stopped at the 5 s grace
        self.assertGreater(elapsed, 12, p.stdout)
        self.assertLess(elapsed, 40, p.stdout)

    def test_a_rank_that_writes_half_a_line_does_not_stall_the_launcher(self):
        # Rank 1 writes text without a newline and waits; rank 0 fails. The launcher still gives
        # the others their grace, stops rank 1, and shows its half line as its last.
        code = ("import os, sys, time\n"
                "if os.environ['RANK'] == '0': time.sleep(2); sys.exit(3)\n"
                "sys.stdout.write('half a line'); sys.stdout.flush()\n"
                "time.sleep(600)\n")
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, self.LAUNCH, "-n", "2", sys.executable, "-c", code], env=base_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=90)
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertIn("launch: rank 0 exited with code 3; stopped the other ranks", p.stdout)
        self.assertIn("[rank 1] half a line\n", p.stdout)
        self.assertLess(time.monotonic() - t0, 40, p.stdout)

    def test_stopping_the_launcher_stops_every_rank(self):
        for sig in (signal.SIGTERM, signal.SIGHUP):
            code = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"
            p = subprocess.Popen([sys.executable, self.LAUNCH, "-n", "2", sys.executable, "-c", code], env=base_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            pids = {}
            deadline = time.monotonic() + 60
            while len(pids) < 2 and time.monotonic() < deadline:
                m = re.match(r"\[rank (\d)\] (\d+)", p.stdout.readline())
                if m:
                    pids[int(m.group(1))] = int(m.group(2))
            self.assertEqual(len(pids), 2, "both ranks started")
            p.send_signal(sig)
            out, _ = p.communicate(timeout=30)
            self.assertEqual(p.returncode, 128 + sig, out)
            self.assertIn(f"launch: stopped by signal {int(sig)}; stopped every rank", out)
            for rank, pid in pids.items():
                with self.assertRaises(ProcessLookupError, msg=f"rank {rank} (pid {pid}) still runs"):
                    os.kill(pid, 0)


if __name__ == "__main__":
    # `test_launch.py Hosts`: the Hosts cases, or CTest's skip (exit 77) where this machine cannot
    # make network namespaces, so that a run without them shows as skipped, not passed.
    if sys.argv[1:] == ["Hosts"] and not network_namespaces_usable():
        print("skipped: tools/launch_hosts needs root, iproute2 and network namespaces")
        sys.exit(77)
    if sys.argv[1:] == ["UnsharedFolder"] and not private_mounts_usable():
        print("skipped: a folder of each rank's own needs root and mount namespaces")
        sys.exit(77)
    unittest.main()
