"""The `shardopt` executable, run as a user runs it: training with a freeze schedule, checkpoints
and resume (bit for bit at the same world size, within float tolerance at another), 1 rank
against 4, the memory report, and bad input.

Run by ctest with the project's Python (torch inside); SHARDOPT_EXE names the executable and
SHARDOPT_TOOLS the tools folder (for read_checkpoint.py).
"""
import csv
import json
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

import torch

EXE = os.environ["SHARDOPT_EXE"]
sys.path.insert(0, os.environ["SHARDOPT_TOOLS"])
import read_checkpoint  # noqa: E402

# 6,400 images, global batch 64: 100 steps per epoch.
SMALL = ["--train-samples", "6400", "--test-samples", "1000", "--batch-size", "64"]
SCHEDULE = ["--freeze", "conv@s50", "--unfreeze", "conv@2"]
# The same, scored on all 10,000 test images: one image is 0.01 points, so wires can be held to
# within half a point of the exact wire's accuracy.
SMALL_ALL_TESTS = [*SMALL[:2], "--test-samples", "0", *SMALL[4:]]
# How far a compressed wire's accuracy may end from the exact wire's, from the same seed.
WITHIN_POINTS = 0.5
# 1,920 images: 30 steps in one epoch, conv frozen for steps 10 to 19.
TINY = ["--epochs", "1", "--train-samples", "1920", "--test-samples", "500", "--batch-size", "64",
        "--freeze", "conv@s10", "--unfreeze", "conv@s20"]
# The same on the ViT, its first block frozen for steps 10 to 19.
TINY_VIT = [*TINY[:8], "--model", "vit", "--freeze", "block0@s10", "--unfreeze", "block0@s20"]


# The Fashion-MNIST folder, where it is not Debian's (tools/gpu_check.sh carries the files).
DATA = os.environ.get("SHARDOPT_DATA")


def run(args, check=True, timeout=600, metrics=False, env=None):
    """`shardopt ARGS` (with `env` added to the environment). A training run writes no metrics file
    (nor draws its chart, about a second of matplotlib per run) unless `metrics` or ARGS name one."""
    if args and args[0] == "train":
        args = train_args(args, metrics)
    p = subprocess.run([EXE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout,
                       env=dict(os.environ, **(env or {})))
    if check and p.returncode != 0:
        raise AssertionError(f"shardopt {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


def train_args(args, metrics=False):
    """`shardopt train` ARGS with the test data folder (where it is not Debian's) and, unless
    `metrics` or ARGS name it, `--metrics off`."""
    if DATA and "--data" not in args:
        args = [*args, "--data", DATA]
    if not metrics and "--metrics" not in args:
        args = [*args, "--metrics", "off"]
    return args


def children_of(pid):
    """The pids of `pid`'s children (from /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def env_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def max_abs_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def mean_abs_diff(a, b):
    """The mean over every element of every tensor."""
    total = sum((a[k] - b[k]).abs().double().sum().item() for k in a)
    return total / sum(a[k].numel() for k in a)


class CliTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="shardopt-cli-")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def torchrun(self):
        """torchrun's command line with a port kept for this test (a socket bound with SO_REUSEADDR,
        not listening, open until the test ends: no other process gets it, and the agent's store
        still binds it), instead of the default 29500 that two tests could share."""
        reserved = socket.socket()
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reserved.bind(("127.0.0.1", 0))
        self.addCleanup(reserved.close)
        return [sys.executable, "-m", "torch.distributed.run", "--master-addr", "127.0.0.1", "--master-port",
                str(reserved.getsockname()[1])]

    def test_train_freeze_checkpoint_resume_bit_exact(self):
        # (With the metrics file a checkpoint folder gets by default, and its chart.)
        full = run(["train", "-n", "2", "--epochs", "2", *SMALL, *SCHEDULE, "--checkpoint-dir", self.path("full"),
                    "--step-in-backward", "on"], metrics=True)
        out = full.stdout
        self.assertIn(f"metrics: {self.path('full/metrics.jsonl')}, chart {self.path('full/metrics.png')}", out)
        with open(self.path("full/metrics.jsonl")) as f:
            self.assertEqual(json.loads(f.readline())["event"], "start")
        self.assertRegex(out, r"step 50 \(epoch 1\): froze conv \(4 tensors, 18,816 parameters\); buckets rebuilt")
        self.assertRegex(out, r"step 100 \(epoch 2\): unfroze conv .*per rank gradients .* -> .*, optimizer state")
        losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
        self.assertGreaterEqual(len(losses), 4, out)
        self.assertLess(losses[-1], 0.7 * losses[0], f"the loss did not fall: {losses}")
        self.assertRegex(out, r"epoch 2/2: test accuracy \d+\.\d+%")
        self.assertTrue(os.path.exists(self.path("full/last.ckpt")))
        # This run steps each bucket in the backward; the interrupted one below steps after it (the
        # default with every rank on one node), with its parameter sync beside the next forward
        # through the freeze, the unfreeze, three checkpoints and an epoch's test, and the resumed
        # one as by default: they end with the very same bits.
        self.assertIn("adam stepped in the backward;", out)
        self.assertNotIn("beside the next forward", out)

        # Interrupted after step 130 (the last checkpoint at step 120), then resumed.
        part = ["train", "-n", "2", "--epochs", "2", *SMALL, *SCHEDULE, "--checkpoint-dir", self.path("part"),
                "--checkpoint-every", "40"]
        stopped = run([*part, "--stop-after-steps", "130", "--overlap-sync", "on"])
        self.assertNotIn("stepped in the backward", stopped.stdout)
        self.assertIn("adam, parameters synced beside the next forward;", stopped.stdout)
        self.assertRegex(stopped.stdout, r"epoch 1/2: test accuracy \d+\.\d+%")
        resumed = run([*part, "--resume"])
        self.assertNotIn("beside the next forward", resumed.stdout)
        self.assertIn("resumed from", resumed.stdout)
        self.assertIn("step 120, epoch 2, step 20 of the epoch", resumed.stdout)
        a = read_checkpoint.load(self.path("full/last.ckpt"))
        b = read_checkpoint.load(self.path("part/last.ckpt"))
        self.assertEqual(a["step"], 200)
        self.assertEqual(b["step"], 200)
        for k in a["model"]:
            self.assertTrue(torch.equal(a["model"][k], b["model"][k]), k)
        for i, state in a["optimizer"]["state"].items():
            for key, value in state.items():
                if torch.is_tensor(value):
                    self.assertTrue(torch.equal(value, b["optimizer"]["state"][i][key]), f"{i} {key}")

        # The optimizer part loads into torch.optim.Adam, each entry on the parameter of its index,
        # and the next step is Adam's update from the saved moments, computed here by hand.
        params = [torch.nn.Parameter(a["model"][k].clone()) for k in a["model"]]
        opt = torch.optim.Adam(params, lr=0.5)
        opt.load_state_dict(a["optimizer"])
        group = opt.param_groups[0]
        self.assertEqual(group["lr"], 1e-3)  # the checkpoint's, not the constructor's
        # (copies: the loaded state may share the checkpoint's tensors, which the step updates in place)
        saved = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                 for i, st in a["optimizer"]["state"].items()}
        self.assertEqual(sorted(saved), list(range(len(params))))
        gen = torch.Generator().manual_seed(3)
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        beta1, beta2 = group["betas"]
        for i, p in enumerate(params):
            s = saved[i]
            self.assertEqual(s["exp_avg"].shape, p.shape, i)
            step = float(s["step"]) + 1
            m = beta1 * s["exp_avg"] + (1 - beta1) * grads[i]
            v = beta2 * s["exp_avg_sq"] + (1 - beta2) * grads[i] ** 2
            update = (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + group["eps"])
            expected = before[i] - group["lr"] * update
            self.assertLessEqual((p.detach() - expected).abs().max().item(), 1e-6, i)
            self.assertGreater((p.detach() - before[i]).abs().max().item(), 1e-5, i)

    def test_muon_trains_through_freezes_and_resumes_bit_exact(self):
        args = ["train", "-n", "2", *TINY, "--optimizer", "muon"]
        full = run([*args, "--checkpoint-dir", self.path("full")])
        out = full.stdout
        self.assertIn("whole-tensor optimizers' parameters whole per owner, balanced by cost", out)
        self.assertRegex(out, r"rank 1: whole-tensor cost \d+(\.\d+)?%, state \d+ bytes")
        self.assertRegex(out, r"step 10 \(epoch 1\): froze conv")
        self.assertRegex(out, r"step 20 \(epoch 1\): unfroze conv")
        accuracy = float(re.findall(r"test accuracy (\d+\.\d+)%", out)[-1])
        self.assertGreater(accuracy, 60.0, out)
        part = [*args, "--checkpoint-dir", self.path("part"), "--checkpoint-every", "10"]
        run([*part, "--stop-after-steps", "25"])
        run([*part, "--resume"])
        a = read_checkpoint.load(self.path("full/last.ckpt"))
        b = read_checkpoint.load(self.path("part/last.ckpt"))
        for k in a["model"]:
            self.assertTrue(torch.equal(a["model"][k], b["model"][k]), k)
        # Muon's group first (the conv and linear weights, one momentum buffer each), then AdamW's.
        groups = a["optimizer"]["param_groups"]
        self.assertEqual(len(groups), 2)
        self.assertIn("ns_coefficients", groups[0])
        self.assertIn("betas", groups[1])
        weights = [k for k in a["model"] if a["model"][k].dim() >= 2]
        self.assertEqual(len(groups[0]["params"]), len(weights))
        for i, k in zip(groups[0]["params"], weights):
            state = a["optimizer"]["state"][i]
            self.assertEqual(set(state), {"momentum_buffer"}, k)
            self.assertEqual(state["momentum_buffer"].shape, a["model"][k].shape, k)
            self.assertTrue(torch.equal(state["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"]), k)

    def test_mixed_precision_trains_and_resumes_bit_exact(self):
        learns = run(["train", "-n", "2", "--epochs", "1", *SMALL, "--freeze", "conv@s50", "--unfreeze", "conv@s75",
                      "--mixed-precision", "bf16", "--checkpoint-dir", self.path("learns")])
        losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", learns.stdout)]
        self.assertLess(losses[-1], 0.7 * losses[0], f"the loss did not fall: {losses}")
        self.assertIn("optimizer state + fp32 master weights", learns.stdout)
        # Stopped during the freeze and resumed, it ends where the straight run does, bit for bit.
        args = ["train", "-n", "2", *TINY, "--mixed-precision", "bf16"]
        run([*args, "--checkpoint-dir", self.path("full")])
        part = [*args, "--checkpoint-dir", self.path("part"), "--checkpoint-every", "5"]
        run([*part, "--stop-after-steps", "15"])
        run([*part, "--resume"])
        a = read_checkpoint.load(self.path("full/last.ckpt"))
        b = read_checkpoint.load(self.path("part/last.ckpt"))
        for k in a["model"]:
            self.assertEqual(a["model"][k].dtype, torch.bfloat16, k)
            self.assertTrue(torch.equal(a["model"][k], b["model"][k]), k)
        # The fp32 masters travel with the optimizer state and are the bf16 parameters, rounded.
        masters = a["optimizer"]["master_weights"]
        for i, k in enumerate(a["model"]):
            self.assertEqual(masters[i].dtype, torch.float32)
            self.assertTrue(torch.equal(masters[i], b["optimizer"]["master_weights"][i]), k)
            self.assertTrue(torch.equal(masters[i].to(torch.bfloat16), a["model"][k]), k)
        # fp16 runs through the sharded loss scaler and says what it skipped. On the ViT: PyTorch's
        # CPU convolution backward in fp16 takes about 60x fp32's (1.4 s a step for the CNN).
        fp16_args = ["train", "-n", "2", *TINY_VIT, "--mixed-precision", "fp16"]
        fp16 = run([*fp16_args, "--checkpoint-dir", self.path("fp16")])
        self.assertRegex(fp16.stdout, r"fp16: \d+ steps skipped for inf/nan gradients, loss scale \d+")
        self.assertRegex(fp16.stdout, r"test accuracy \d+\.\d+%")
        # The loss scale and its growth tracker travel in the checkpoint: stopped during the
        # freeze and resumed, the fp16 run ends where the straight one does, bit for bit, scale
        # included.
        part = [*fp16_args, "--checkpoint-dir", self.path("fp16-part"), "--checkpoint-every", "5"]
        run([*part, "--stop-after-steps", "15"])
        run([*part, "--resume"])
        a = read_checkpoint.load(self.path("fp16/last.ckpt"))
        b = read_checkpoint.load(self.path("fp16-part/last.ckpt"))
        self.assertIn("loss_scale", a["scalars"])
        self.assertEqual(a["scalars"]["loss_scale"], b["scalars"]["loss_scale"])
        self.assertEqual(a["scalars"]["loss_scale_growth_tracker"], b["scalars"]["loss_scale_growth_tracker"])
        self.assertTrue(any(v.dtype == torch.float16 for v in a["model"].values()))
        for k in a["model"]:
            self.assertTrue(torch.equal(a["model"][k], b["model"][k]), k)

    @unittest.skipUnless(torch.cuda.is_available(), "no CUDA device visible: not run")
    def test_cuda_trains_freezes_and_resumes_bit_exact(self):
        # NCCL, the model and the data on the GPU, through a freeze and an unfreeze (TINY), in fp32
        # and in bf16 (the mixed kernel steps the masters); an interrupted run resumes bit-exactly.
        for precision in ["off", "bf16"]:
            args = ["train", *TINY, "--device", "cuda", "--mixed-precision", precision, "--clip", "1"]
            full = run([*args, "--checkpoint-dir", self.path(f"full-{precision}")])
            self.assertIn("1 rank on CUDA (NCCL)", full.stdout)
            self.assertRegex(full.stdout, r"step 10 \(epoch 1\): froze conv")
            self.assertRegex(full.stdout, r"step 20 \(epoch 1\): unfroze conv")
            accuracy = float(re.findall(r"test accuracy (\d+\.\d+)%", full.stdout)[-1])
            self.assertGreater(accuracy, 50.0, full.stdout)
            part = [*args, "--checkpoint-dir", self.path(f"part-{precision}"), "--checkpoint-every", "5"]
            run([*part, "--stop-after-steps", "15"])
            run([*part, "--resume"])
            a = read_checkpoint.load(self.path(f"full-{precision}/last.ckpt"))
            b = read_checkpoint.load(self.path(f"part-{precision}/last.ckpt"))
            for k in a["model"]:
                self.assertEqual(a["model"][k].dtype, torch.bfloat16 if precision == "bf16" else torch.float32, k)
                self.assertTrue(torch.equal(a["model"][k], b["model"][k]), k)
        # More local ranks than GPUs: NCCL would refuse two ranks on one GPU; every rank says why,
        # in one line, at once.
        ranks = torch.cuda.device_count() + 1
        p = run(["train", "-n", str(ranks), "--device", "cuda", *TINY], check=False, timeout=120)
        self.assertNotEqual(p.returncode, 0)
        lines = [l for l in p.stderr.splitlines() if "NCCL needs a GPU of its own for each rank" in l]
        self.assertEqual(len(lines), ranks, p.stderr)

    def signal_a_rank_mid_epoch(self, rank, sig, timeout="15", act=None, extra=(), samples="60000"):
        """`shardopt train -n 3 --timeout TIMEOUT` (with `extra` options); `sig` to `rank` once
        training runs (or, with `act`, act(pids by rank), which returns None or why the test is
        skipped). Returns the exit code, stderr and the seconds from the signal to the exit."""
        p = subprocess.Popen([EXE, "train", "-n", "3", "--epochs", "1", "--train-samples", samples,
                              "--test-samples", "500", "--timeout", timeout, *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ranks = {}
            deadline = time.monotonic() + 60
            while len(ranks) < 3 and time.monotonic() < deadline:
                for child in children_of(p.pid):
                    r = env_of(child).get("RANK")
                    if r is not None:
                        ranks[int(r)] = child
                time.sleep(0.2)
            self.assertEqual(sorted(ranks), [0, 1, 2])
            line = p.stdout.readline()  # the first line: the ranks are training
            self.assertIn("training the CNN", line)
            time.sleep(2)
            if act is None:
                os.kill(ranks[rank], sig)
            elif (why := act(ranks)) is not None:
                for pid in [*ranks.values(), p.pid]:
                    os.kill(pid, signal.SIGKILL)
                p.wait()
                self.skipTest(why)
            t0 = time.monotonic()
            _, err = p.communicate(timeout=120)
            elapsed = time.monotonic() - t0
        finally:
            if p.poll() is None:
                p.kill()
        for r, pid in ranks.items():
            with self.assertRaises(ProcessLookupError, msg=f"rank {r} (pid {pid}) still runs"):
                os.kill(pid, 0)
        return p.returncode, err, elapsed

    def test_a_stopped_rank_does_not_hang_the_launcher(self):
        # Rank 2 stopped with SIGSTOP mid-epoch: ranks 0 and 1 name it within the timeout and
        # exit, and `-n 3` then ends rank 2 too and exits non-zero, instead of waiting on it.
        code, err, elapsed = self.signal_a_rank_mid_epoch(2, signal.SIGSTOP)
        self.assertNotEqual(code, 0)
        # (Silent for the heartbeat timeout, or, where the others waited on it that long, for the
        # hung-rank one: both name a stopped rank.)
        self.assertRegex(err, r"rank 2 stopped answering \(no heartbeat for (3 s: exited, killed or hung|"
                              r"10 s while the others waited on it: stopped or hung)\)")
        self.assertLess(elapsed, 15 + 3 + 5 + 10 + 20, err)

    def test_survive_failures_stops_a_stopped_rank_and_exits_0(self):
        # Rank 2 stopped with SIGSTOP mid-epoch under --survive-failures: ranks 0 and 1 go on
        # without it and finish; `-n 3` then gives rank 2 until 30 s after the first exit, stops it
        # (SIGTERM with SIGCONT), names it, and exits 0: the run succeeded without that rank.
        code, err, elapsed = self.signal_a_rank_mid_epoch(2, signal.SIGSTOP, extra=("--survive-failures",),
                                                          samples="12000")
        self.assertEqual(code, 0, err)
        self.assertIn("shardopt: rank 2 exited with code 143 after the others finished", err)
        self.assertGreater(elapsed, 30, err)

    def test_a_hung_rank_is_killed_10_s_after_sigterm(self):
        # Rank 2 hung where no signal but SIGKILL reaches it (held in a ptrace stop: SIGCONT does not
        # resume it, SIGTERM waits), rank 1 killed: `-n 3` sends the ranks still there SIGTERM 5 s
        # after the failure and kills each one left 10 s later, naming it, instead of waiting on it.
        # (Every thread held: a thread left running would take SIGTERM's default action.)
        tracer = ("import ctypes, os, sys\n"
                  "libc = ctypes.CDLL(None, use_errno=True)\n"
                  "pid, held = int(sys.argv[1]), set()\n"
                  "while tids := {int(t) for t in os.listdir(f'/proc/{pid}/task')} - held:\n"
                  "    for tid in tids:\n"
                  "        if libc.ptrace(16, tid, None, None) != 0:\n"  # PTRACE_ATTACH
                  "            if ctypes.get_errno() == 3: held.add(tid); continue\n"  # gone already
                  "            print('ptrace refused: errno', ctypes.get_errno(), flush=True); sys.exit(3)\n"
                  "        os.waitpid(tid, 0x40000000)\n"  # its stop (__WALL)
                  "        held.add(tid)\n"
                  "print('attached', len(held), 'threads', flush=True)\n"
                  "while True:\n"  # never resumes them: waits until the process is gone
                  "    got, status = os.waitpid(-1, 0x40000000)\n"
                  "    if got == pid and (os.WIFEXITED(status) or os.WIFSIGNALED(status)): break\n")
        held = []

        def hang_rank_2(ranks):
            t = subprocess.Popen([sys.executable, "-c", tracer, str(ranks[2])], stdout=subprocess.PIPE, text=True)
            held.append(t)
            said = t.stdout.readline()
            if "attached" not in said:
                t.wait()
                return said.strip()
            os.kill(ranks[1], signal.SIGKILL)
            return None

        code, err, elapsed = self.signal_a_rank_mid_epoch(1, None, timeout="60", act=hang_rank_2)
        for t in held:
            t.wait(timeout=30)
        self.assertNotEqual(code, 0)
        self.assertIn("shardopt: rank 2 did not stop within 10 s of SIGTERM; killed it", err)
        self.assertIn("shardopt: rank 1 exited with code 137", err)
        # 5 s for the others to exit by themselves, then 10 s after SIGTERM.
        self.assertGreater(elapsed, 14.5, err)
        self.assertLess(elapsed, 5 + 10 + 20, err)

    def test_rank_0_killed_is_named_by_the_others(self):
        # The store lives in the launcher (`-n N` serves it): rank 0's death does not take it
        # along, and ranks 1 and 2 name rank 0 like any other rank.
        code, err, elapsed = self.signal_a_rank_mid_epoch(0, signal.SIGKILL)
        self.assertNotEqual(code, 0)
        self.assertIn("shardopt: rank 0 exited with code 137", err)
        # Both survivors name rank 0, each in one line: a rank reporting the failure has until 30 s
        # after it before the launcher stops it (Note [The others' grace] in local_ranks.cpp).
        reports = [l for l in err.splitlines() if re.match(r"shardopt: rank [12]: ", l)]
        self.assertEqual(sorted(l[len("shardopt: rank "):][0] for l in reports), ["1", "2"], err)
        for line in reports:
            self.assertIn("rank 0 stopped answering", line)
        self.assertNotIn("cannot be reached", err)
        self.assertLess(elapsed, 15 + 3 + 5 + 20, err)

    def test_survive_failures_saves_synchronously_and_survives_a_death_in_the_save(self):
        # Rank 1 dies as the first save commits its main file. Only the synchronous save has that
        # phase (the asynchronous one takes a snapshot, then writes in the background), so the
        # death shows that --survive-failures saves synchronously; the run survives it, admits the
        # replacement at step 20, and ends 0.
        args = ["train", "--epochs", "2", "--train-samples", "1920", "--test-samples", "500", "--batch-size", "120",
                "-n", "3", "--survive-failures", "--refresh-every", "5", "--checkpoint-dir", self.path("run")]
        env = dict(os.environ, SHARDOPT_FAULT_IN_PHASE="1:saving a checkpoint (committing its main file)",
                   SHARDOPT_AWAIT_JOINER_AT_STEP="20")
        p = subprocess.run([EXE, *train_args(args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertRegex(p.stdout, r"rank 1 died \(seen in saving a checkpoint \(committing its main file\)\)")
        self.assertRegex(p.stdout, r"global rank 1 joined at step 20; world size 2 -> 3")
        # (The step whose save failed is run again from the refresh before it: 33 steps run.)
        self.assertRegex(p.stdout, r"epoch 2/2  step 32/32 .*\nepoch 2/2: test accuracy")
        self.assertRegex(p.stdout, r"done: 33 steps")

    def test_survive_failures_goes_on_after_a_rank_dies(self):
        # 4 ranks, rank 2 killed with SIGKILL before step 20 of 54: the other three go on at world
        # size 3 with the same global batches, take its replacement back at step 25, and reach the
        # accuracy of an uninterrupted run.
        args = ["train", "--epochs", "1", "--train-samples", "6480", "--test-samples", "1000", "--batch-size", "120",
                "-n", "4", "--survive-failures", "--refresh-every", "5"]
        full = run([*args, "--checkpoint-dir", self.path("full")])
        acc_full = float(re.search(r"test accuracy (\d+\.\d+)%", full.stdout).group(1))
        # (The run waits before its refresh at step 25 until the replacement has asked to join, so
        # that it is admitted there however long it takes to start.)
        env = dict(os.environ, SHARDOPT_FAULT_AT_STEP="2:20", SHARDOPT_AWAIT_JOINER_AT_STEP="25")
        p = subprocess.run([EXE, *train_args([*args, "--checkpoint-dir", self.path("survived")])], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=600)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("surviving failures: buddy copies of every shard", p.stdout)
        self.assertRegex(p.stdout, r"step 20 \(epoch 1\): rank 2 died \(seen in [^)]+\)+ at step 20; rolled back 0 steps "
                                   r"to step 20; world size 4 -> 3; recovered in \d+\.\d s")
        self.assertIn("shardopt: rank 2 was killed by signal 9; the others go on without it", p.stderr)
        self.assertIn("shardopt: the run survived the loss of a rank", p.stderr)
        # The tool starts a replacement for rank 2, which the run admits after its next refresh
        # (step 25): the run ends at 4 ranks again.
        self.assertIn("shardopt: started a replacement for rank 2", p.stderr)
        self.assertRegex(p.stdout, r"step 25 \(epoch 1\): global rank 2 joined at step 25; world size 3 -> 4")
        self.assertRegex(p.stdout, r"memory per rank: optimizer state [^/]+/[^/]+/[^/]+/[^/]+ of")
        self.assertRegex(p.stdout, r"done: 54 steps")
        acc = float(re.search(r"test accuracy (\d+\.\d+)%", p.stdout).group(1))
        self.assertGreater(acc_full, 60.0)
        self.assertLess(abs(acc - acc_full), 1.0, p.stdout)
        # The parameters, not only the accuracy: the same global batches at world 4, 3 and 4 again
        # end where the uninterrupted run ends, up to the order of float sums. Adam turns that
        # order into up to 3.9e-4 on the few elements whose second moment is tiny (measured with
        # MKL_CBWR=COMPATIBLE, as CI runs; 1.6e-6 without), 1.5e-7 on average. A lost or doubled
        # step at lr 1e-3 moves nearly every parameter by up to 1e-3: the mean tells them apart.
        a = read_checkpoint.load(self.path("full/last.ckpt"))
        b = read_checkpoint.load(self.path("survived/last.ckpt"))
        self.assertEqual(a["step"], b["step"])
        self.assertLessEqual(max_abs_diff(a["model"], b["model"]), 1e-3, p.stdout)
        self.assertLessEqual(mean_abs_diff(a["model"], b["model"]), 1e-5, p.stdout)

    def test_survive_failures_bad_input_is_one_line(self):
        p = run(["train", "--epochs", "1", "--train-samples", "640", "--survive-failures"], check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertEqual(p.stderr.strip().count("\n"), 0, p.stderr)
        self.assertIn("surviving a dead rank needs at least 2 ranks", p.stderr)
        # Refused as the command line is read, before any rank starts: one line, not one per rank.
        p = run(["train", "--epochs", "1", "--train-samples", "640", "-n", "2", "--survive-failures",
                 "--refresh-every", "0"], check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertEqual(p.stderr.strip().splitlines(),
                         ["shardopt: --refresh-every: must be positive, got 0 (see shardopt train --help)"])
        self.assertEqual(p.stdout, "")

    def test_survive_failures_with_bf16_fp16_and_muon(self):
        # 3 ranks, rank 1 killed before step 12 of 30: the other two go on at world size 2 in each
        # precision, with Muon and on int8 wires with error feedback (the masters travel in the
        # copies; the residuals start at zero in the new group), take the replacement back at
        # step 15 (it receives the parameters in the members' dtype, and fp16's loss scale),
        # finish every step, and train (fp16: the loss scale travels in the copies, and the run
        # reports it).
        # (fp16 on the ViT: PyTorch's CPU convolution backward in fp16 takes about 60x fp32's.)
        # The end's checkpoint shows what went through the recovery and the rejoin: the fp32 masters
        # whose rounding is the model, the loss scale the run reports, Muon's momentum.
        for extra in (["--mixed-precision", "bf16"], ["--mixed-precision", "fp16", "--model", "vit"],
                      ["--optimizer", "muon"],
                      ["--gradient-wire", "int8", "--param-wire", "int8", "--error-feedback"]):
            with self.subTest(extra=extra):
                env = dict(os.environ, SHARDOPT_FAULT_AT_STEP="1:12", SHARDOPT_AWAIT_JOINER_AT_STEP="15")
                ckpt = self.path("-".join(extra).replace("--", ""))
                p = subprocess.run([EXE, "train", "--epochs", "1", "--train-samples", "3600", "--test-samples", "500",
                                    "--batch-size", "120", "-n", "3", "--survive-failures", "--refresh-every", "5",
                                    "--checkpoint-dir", ckpt, "--metrics", "off", *extra], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertRegex(p.stdout, r"step 12 \(epoch 1\): rank 1 died \(seen in [^)]+\)+ at step 12; rolled "
                                           r"back \d+ steps? to step 10; world size 3 -> 2")
                self.assertIn("shardopt: the run survived the loss of a rank", p.stderr)
                # (30 steps, and the 2 run again after the roll-back; the replacement rejoins at 15)
                self.assertRegex(p.stdout, r"done: 32 steps")
                self.assertRegex(p.stdout, r"global rank 1 joined at step 15; world size 2 -> 3")
                accuracy = float(re.findall(r"test accuracy (\d+\.\d+)%", p.stdout)[-1])
                self.assertGreater(accuracy, 50.0, p.stdout)
                saved = read_checkpoint.load(os.path.join(ckpt, "last.ckpt"))
                self.assertEqual(saved["step"], 30)
                if "--mixed-precision" in extra:
                    low = torch.bfloat16 if "bf16" in extra else torch.float16
                    masters = saved["optimizer"]["master_weights"]
                    for i, k in enumerate(saved["model"]):
                        self.assertEqual(masters[i].dtype, torch.float32, k)
                        self.assertTrue(torch.equal(masters[i].to(low), saved["model"][k]), k)
                if "fp16" in extra:
                    scale = re.search(r"fp16: \d+ steps skipped for inf/nan gradients, loss scale (\d+)", p.stdout)
                    self.assertIsNotNone(scale, p.stdout)
                    self.assertEqual(saved["scalars"]["loss_scale"], float(scale.group(1)))
                if "muon" in extra:
                    # Muon's momentum on every 2-D weight it steps (conv kernels flattened), every
                    # one finite and moved.
                    buffers = [st["momentum_buffer"] for st in saved["optimizer"]["state"].values()
                               if "momentum_buffer" in st]
                    self.assertGreaterEqual(len(buffers), 2, saved["optimizer"]["state"].keys())
                    for b in buffers:
                        self.assertTrue(bool(torch.isfinite(b).all()) and b.abs().max() > 0)

    def test_torchrun_starts_the_ranks(self):
        p = subprocess.run([*self.torchrun(), "--no-python", "--nproc-per-node", "2",
                            EXE, "train", "--epochs", "1", "--train-samples", "1200", "--test-samples", "200"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertRegex(p.stdout, r"2 ranks on CPU \(Gloo\), global batch 120")
        self.assertRegex(p.stdout, r"done: 10 steps .*test accuracy \d+\.\d+%")

    def test_torchrun_restart_resumes_from_the_checkpoint(self):
        # Under torchrun --max-restarts 1, rank 1 kills itself before step 15 (after the checkpoint
        # of step 10); the agent restarts both workers, which resume from step 10 by themselves
        # and end bit for bit where an uninterrupted run at the same world size ends.
        args = ["train", *TINY, "--checkpoint-every", "10"]
        run([*args, "-n", "2", "--checkpoint-dir", self.path("full")])
        env = dict(os.environ, SHARDOPT_FAULT_AT_STEP="1:15")
        p = subprocess.run([*self.torchrun(), "--no-python", "--nproc-per-node", "2",
                            "--max-restarts", "1", EXE, *train_args([*args, "--checkpoint-dir", self.path("restarted")])],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("restarted by torchrun (restart 1): resumed from", p.stdout)
        self.assertIn("step 10, epoch 1, step 10 of the epoch", p.stdout)
        a = read_checkpoint.load(self.path("full/last.ckpt"))
        b = read_checkpoint.load(self.path("restarted/last.ckpt"))
        self.assertEqual(b["step"], 30)
        for k in a["model"]:
            self.assertTrue(torch.equal(a["model"][k], b["model"][k]), k)

    def test_metrics_file_parses_and_the_chart_is_drawn(self):
        metrics = self.path("m.jsonl")
        p = run(["train", "-n", "2", *TINY, "--metrics", metrics])
        with open(metrics) as f:
            records = [json.loads(line) for line in f]
        self.assertEqual(records[0]["event"], "start")
        self.assertEqual(records[0]["world"], 2)
        steps = [r for r in records if "loss" in r]
        self.assertEqual([r["step"] for r in steps], list(range(30)))
        for r in steps:
            self.assertGreater(r["loss"], 0)
            self.assertGreater(r["samples_per_s"], 0)
        # conv frozen at step 10, unfrozen at step 20; each event with every rank's bytes
        events = [r for r in records if r.get("event") in ("freeze", "unfreeze")]
        self.assertEqual([(e["event"], e["step"]) for e in events], [("freeze", 10), ("unfreeze", 20)])
        self.assertTrue(events[0]["what"].startswith("froze conv"), events[0])
        for e in events:
            self.assertEqual(len(e["state_bytes_after"]), 2)
            self.assertEqual(len(e["grad_bytes_after"]), 2)
        # freezing the convolutions leaves every rank fewer gradient bytes until they are unfrozen
        self.assertLess(sum(events[0]["grad_bytes_after"]), sum(events[0]["grad_bytes_before"]))
        memory = [r for r in records if "state_bytes" in r and "event" not in r]
        self.assertGreaterEqual(len(memory), 3)
        for m in memory:
            self.assertEqual(len(m["state_bytes"]), 2)
            self.assertTrue(all(b > 0 for b in m["state_bytes"]), m)
        accuracy = [r for r in records if "test_accuracy" in r and "event" not in r]
        self.assertEqual(len(accuracy), 1)
        self.assertTrue(0 < accuracy[0]["test_accuracy"] <= 1)
        self.assertEqual(records[-1]["event"], "done")
        self.assertEqual(records[-1]["steps"], 30)
        png = self.path("m.png")
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        self.assertGreater(os.path.getsize(png), 20000)
        self.assertIn("chart " + png, p.stdout)
        # A folder that cannot be written is one line on every rank, before any training.
        bad = run(["train", "-n", "2", *TINY, "--metrics", "/nonexistent/m.jsonl"], check=False)
        self.assertNotEqual(bad.returncode, 0)
        lines = [l for l in bad.stderr.splitlines() if l.strip() and "exited with code" not in l]
        self.assertEqual(len(lines), 2, bad.stderr)
        for line in lines:
            self.assertIn("--metrics '/nonexistent/m.jsonl': the folder '/nonexistent' does not exist", line)

    def test_compressed_wires_train_like_the_exact_wire(self):
        # The same seed and schedule; only the way gradients and parameters travel differs.
        args = ["train", "-n", "2", "--epochs", "2", *SMALL_ALL_TESTS, *SCHEDULE]
        exact = run([*args, "--checkpoint-dir", self.path("exact")])
        self.assertIn("/10000)", exact.stdout)  # every test image scored
        accuracy = lambda p: float(re.findall(r"test accuracy (\d+\.\d+)%", p.stdout)[-1])
        a = read_checkpoint.load(self.path("exact/last.ckpt"))["model"]
        bf16 = ["--gradient-wire", "bf16", "--param-wire", "bf16"]
        for name, wires in (("bf16", bf16),
                            ("int8", ["--gradient-wire", "int8", "--param-wire", "int8"]),
                            ("int8-feedback", ["--gradient-wire", "int8", "--param-wire", "int8", "--error-feedback"])):
            got = run([*args, "--checkpoint-dir", self.path(name), *wires])
            self.assertLessEqual(abs(accuracy(got) - accuracy(exact)), WITHIN_POINTS, f"{exact.stdout}\n{got.stdout}")
            b = read_checkpoint.load(self.path(f"{name}/last.ckpt"))["model"]
            self.assertGreater(max_abs_diff(a, b), 0, f"the {name} wire changed nothing")

        # On bf16 wires the fp32 parameters are the owners' fp32 masters rounded to bf16, and a
        # resumed run goes on from the exact masters in the checkpoint (stopped during the freeze).
        tiny = ["train", "-n", "2", *TINY, *bf16]
        run([*tiny, "--checkpoint-dir", self.path("tiny")])
        part = [*tiny, "--checkpoint-dir", self.path("part"), "--checkpoint-every", "5"]
        run([*part, "--stop-after-steps", "15"])
        run([*part, "--resume"])
        a = read_checkpoint.load(self.path("tiny/last.ckpt"))
        b = read_checkpoint.load(self.path("part/last.ckpt"))
        masters = a["optimizer"]["master_weights"]
        for i, k in enumerate(a["model"]):
            self.assertEqual(a["model"][k].dtype, torch.float32, k)
            self.assertTrue(torch.equal(a["model"][k], b["model"][k]), k)
            self.assertTrue(torch.equal(masters[i], b["optimizer"]["master_weights"][i]), k)
            self.assertTrue(torch.equal(masters[i].to(torch.bfloat16).float(), a["model"][k]), k)
            self.assertFalse(torch.equal(masters[i], a["model"][k]), f"{k}: nothing was rounded")

    def test_bf16_state_halves_the_state_and_resumes_bit_exact(self):
        # --state-format bf16: the owners keep Adam's moments in bf16; the consolidated checkpoint
        # holds them widened to fp32, the sharded one as they are, and a run stopped during the
        # freeze and resumed from its sharded checkpoint ends where the straight one does, bit for
        # bit.
        args = ["train", "-n", "2", *TINY, "--state-format", "bf16"]
        full = run([*args, "--checkpoint-dir", self.path("full")])
        self.assertIn("optimizer state in bf16", full.stdout)
        self.assertGreater(float(re.findall(r"test accuracy (\d+\.\d+)%", full.stdout)[-1]), 60.0, full.stdout)
        part = [*args, "--checkpoint-dir", self.path("part"), "--checkpoint-every", "5", "--sharded-checkpoint"]
        run([*part, "--stop-after-steps", "15"])
        run([*part, "--resume"])
        a = read_checkpoint.load(self.path("full/last.ckpt"))
        b = read_checkpoint.load(self.path("part/last.ckpt"))
        for k in a["model"]:
            self.assertTrue(torch.equal(a["model"][k], b["model"][k]), k)
        for i, state in a["optimizer"]["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                t = state[key]
                self.assertEqual(t.dtype, torch.float32, f"{i} {key}")
                self.assertTrue(torch.equal(t, t.bfloat16().float()), f"{i} {key}: not bf16 values")
        # Each rank's state is half the fp32 run's; an fp32 checkpoint resumes in bf16, converted,
        # and the run says so.
        state_bytes = lambda p: [int(x) for x in re.findall(r"rank \d: state (\d+) bytes", p.stdout)]
        fp32 = ["train", "-n", "2", *TINY, "--checkpoint-dir", self.path("fp32"), "--checkpoint-every", "5"]
        first = run([*fp32, "--stop-after-steps", "15"])
        self.assertEqual([2 * n for n in state_bytes(full)], state_bytes(first), f"{full.stdout}\n{first.stdout}")
        resumed = run([*fp32, "--state-format", "bf16", "--resume"])
        self.assertIn("resumed with --state-format bf16 (the checkpoint was written with fp32): its optimizer state "
                      "was converted", resumed.stdout)
        self.assertIn("optimizer state in bf16", resumed.stdout)

    def test_int8_state_keeps_a_quarter_of_the_state_and_resumes_bit_exact(self):
        # --state-format int8: the owners keep Adam's moments of the larger tensors in 8-bit blockwise
        # codes; the consolidated checkpoint holds them decoded to fp32 (loadable by torch.optim), and
        # a run stopped during the freeze and resumed from its sharded checkpoint ends where the
        # straight one does, bit for bit. Each rank's state is at most 0.3 of the fp32 run's.
        args = ["train", "-n", "2", *TINY, "--state-format", "int8"]
        full = run([*args, "--checkpoint-dir", self.path("full")])
        self.assertIn("optimizer state in int8", full.stdout)
        self.assertGreater(float(re.findall(r"test accuracy (\d+\.\d+)%", full.stdout)[-1]), 60.0, full.stdout)
        part = [*args, "--checkpoint-dir", self.path("part"), "--checkpoint-every", "5", "--sharded-checkpoint"]
        run([*part, "--stop-after-steps", "15"])
        run([*part, "--resume"])
        a = read_checkpoint.load(self.path("full/last.ckpt"))
        b = read_checkpoint.load(self.path("part/last.ckpt"))
        for k in a["model"]:
            self.assertTrue(torch.equal(a["model"][k], b["model"][k]), k)
        coded = 0
        for i, state in a["optimizer"]["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                t = state[key]
                self.assertEqual(t.dtype, torch.float32, f"{i} {key}")
                if t.numel() >= 4096:  # decoded codes: at most 256 values in each block of 256
                    coded += 1
                    blocks = t.reshape(-1)[: t.numel() // 256 * 256].reshape(-1, 256)
                    self.assertTrue(all(len(torch.unique(row)) < 200 for row in blocks[:8]), f"{i} {key}: not codes")
        self.assertGreater(coded, 0)
        # The decoded moments load into torch.optim.Adam, which steps from them.
        params = [torch.nn.Parameter(a["model"][k].clone()) for k in a["model"]]
        opt = torch.optim.Adam(params)
        opt.load_state_dict(a["optimizer"])
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        self.assertTrue(all(torch.isfinite(p).all() for p in params))
        state_bytes = lambda p: [int(x) for x in re.findall(r"rank \d: state (\d+) bytes", p.stdout)]
        fp32 = run(["train", "-n", "2", *TINY, "--stop-after-steps", "15"])
        for int8, f32 in zip(state_bytes(full), state_bytes(fp32), strict=True):
            self.assertLessEqual(int8, 0.3 * f32, f"{full.stdout}\n{fp32.stdout}")

    def test_vit_trains_on_int8_wires_like_the_exact_wire(self):
        # The Vision Transformer, its embedding and first block frozen for part of the epoch: int8
        # gradients and parameters end within half a point of the exact wires' accuracy from the same
        # seed (the full schedule's figures are in docs/benchmarks-log.md).
        args = ["train", "-n", "2", "--model", "vit", "--epochs", "1", *SMALL_ALL_TESTS, "--freeze", "embed@s30",
                "--freeze", "block0@s30", "--unfreeze", "embed@s70", "--unfreeze", "block0@s70"]
        exact = run([*args, "--checkpoint-dir", self.path("exact")])
        self.assertIn("training the ViT (139,018 parameters)", exact.stdout)
        self.assertIn("froze embed (4 tensors, 4,352 parameters)", exact.stdout)
        self.assertRegex(exact.stdout, r"froze block0 \(12 tensors, 33,472 parameters\)")
        int8 = run([*args, "--checkpoint-dir", self.path("int8"), "--gradient-wire", "int8", "--param-wire", "int8"])
        accuracy = lambda p: float(re.findall(r"test accuracy (\d+\.\d+)%", p.stdout)[-1])
        self.assertGreater(accuracy(exact), 60.0, exact.stdout)  # it learns (10 classes: 10% by chance)
        self.assertLessEqual(abs(accuracy(int8) - accuracy(exact)), WITHIN_POINTS, f"{exact.stdout}\n{int8.stdout}")
        a = read_checkpoint.load(self.path("exact/last.ckpt"))["model"]
        b = read_checkpoint.load(self.path("int8/last.ckpt"))["model"]
        self.assertIn("block3.attn.qkv.weight", a)
        self.assertGreater(max_abs_diff(a, b), 0, "the int8 wires changed nothing")

    def test_error_feedback_resumes_bit_exact_from_a_sharded_checkpoint(self):
        # int8 wires with error feedback: each rank's residuals are saved beside its optimizer
        # part, and a run stopped during the freeze (the layout the residuals follow) and resumed
        # ends where the straight run does, bit for bit. Resumed at 4 ranks, it starts the
        # residuals at zero and says so.
        args = ["train", "-n", "2", *TINY, "--gradient-wire", "int8", "--param-wire", "int8", "--error-feedback",
                "--sharded-checkpoint"]
        run([*args, "--checkpoint-dir", self.path("full")])
        part = [*args, "--checkpoint-dir", self.path("part"), "--checkpoint-every", "5"]
        run([*part, "--stop-after-steps", "15"])
        saved = sorted(f for f in os.listdir(self.path("part")) if ".feedback-" in f)
        self.assertEqual([f.split(".")[2] for f in saved], ["feedback-0-of-2", "feedback-1-of-2"], saved)
        shutil.copytree(self.path("part"), self.path("other"))  # the same checkpoint, resumed below at 4 ranks
        run([*part, "--resume"])
        a = read_checkpoint.load(self.path("full/last.ckpt"))["model"]
        b = read_checkpoint.load(self.path("part/last.ckpt"))["model"]
        for k in a:
            self.assertTrue(torch.equal(a[k], b[k]), k)
        # At another world size the residuals are dropped, and the run says so.
        other = [*args[:2], "4", *args[3:], "--checkpoint-dir", self.path("other"), "--checkpoint-every", "5"]
        resumed = run([*other, "--resume"])
        said = [l for l in resumed.stderr.splitlines() if "error-feedback residuals" in l]
        self.assertTrue(said and "start at zero" in said[0] and "saved at 2 ranks" in said[0], resumed.stderr)

    def test_one_rank_and_four_ranks_end_within_1e_4(self):
        run(["train", *TINY, "--checkpoint-dir", self.path("one")])
        run(["train", *TINY, "-n", "4", "--checkpoint-dir", self.path("four")])
        a = read_checkpoint.load(self.path("one/last.ckpt"))["model"]
        b = read_checkpoint.load(self.path("four/last.ckpt"))["model"]
        self.assertLessEqual(max_abs_diff(a, b), 1e-4)

    def test_resume_at_another_world_size(self):
        args = ["train", *TINY]
        run([*args, "-n", "2", "--checkpoint-dir", self.path("full")])
        run([*args, "-n", "2", "--checkpoint-dir", self.path("part"), "--checkpoint-every", "10",
             "--stop-after-steps", "20"])
        resumed = run([*args, "-n", "4", "--checkpoint-dir", self.path("part"), "--resume"])
        self.assertIn("step 20, epoch 1, step 20 of the epoch", resumed.stdout)
        a = read_checkpoint.load(self.path("full/last.ckpt"))["model"]
        b = read_checkpoint.load(self.path("part/last.ckpt"))["model"]
        self.assertLessEqual(max_abs_diff(a, b), 1e-4)

    def test_one_slurm_task_starts_the_ranks_asked_for(self):
        # A shell inside a SLURM allocation (one srun task) runs `shardopt train -n 2`: it starts
        # the two ranks, as without a launcher, and says so; they train at world 2.
        slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "4242",
                 "SLURM_JOB_NODELIST": "node[07-08]"}
        p = run(["train", "-n", "2", *TINY, "--checkpoint-dir", self.path("slurm")], env=slurm)
        self.assertIn("shardopt: one SLURM task (SLURM_NTASKS=1): -n 2 starts 2 ranks on this node", p.stdout)
        self.assertIn("2 ranks on CPU (Gloo)", p.stdout)
        self.assertRegex(p.stdout, r"test accuracy \d+\.\d+%")

    def test_help_lists_the_options(self):
        # Each command's --help names its options (README: "list the options") and exits 0.
        for command, options in (("train", ("--epochs", "--freeze", "--state-format", "--survive-failures", "-n")),
                                 ("memory", ("--preset", "--world-sizes", "--modes", "--state-format", "--no-chart")),
                                 ("plan", ("--preset", "--world-sizes", "--state-format"))):
            p = run([command, "--help"])
            for option in options:
                self.assertIn(option, p.stdout, f"shardopt {command} --help")

    def test_bad_input_is_one_line_naming_it_on_every_rank(self):
        def fails(args, needle, ranks=1, env=None):
            p = run(args, check=False, env=env)
            self.assertNotEqual(p.returncode, 0, args)
            lines = [l for l in p.stderr.splitlines() if l.strip() and "exited with code" not in l]
            self.assertEqual(len(lines), ranks, f"{args}: {p.stderr}")
            for line in lines:
                self.assertIn(needle, line, args)
                self.assertNotIn("Exception raised from", line)
        fails(["fly"], "fly")
        fails(["train", "--no-such-option"], "--no-such-option")
        fails(["memory", "--preset", "nope"], "nope")
        fails(["memory", "--optimizer", "muon", "--state-format", "bf16"], "--state-format bf16 holds Adam's state, not Muon's")
        fails(["train", "-n", "2", "--optimizer", "muon", "--state-format", "bf16", *SMALL],
              "OSSOptions::state_format(bf16): param group 0's optimizer is shardopt::Muon", ranks=2)
        fails(["train", "--state-format", "int4"], "int4")
        fails(["plan", "--state-format", "fp8"], "fp8")
        fails(["train", "--device", "tpu"], "tpu")
        if not torch.cuda.is_available():
            fails(["train", "--device", "cuda", *SMALL], "--device cuda: no CUDA device is visible")
        fails(["train", "-n", "2", "--freeze", "nope@1", *SMALL], "no parameter name starts with 'nope'", ranks=2)
        fails(["train", "-n", "2", "--freeze", "conv@1", "--freeze", "fc@1", *SMALL],
              "freezes every parameter of the model", ranks=2)
        fails(["train", "-n", "2", "--data", self.path("nowhere")], f"data folder '{self.path('nowhere')}' does not exist",
              ranks=2)
        # srun started 4 tasks, each asked for 2 ranks: refused in one line (by each task started here: one).
        fails(["train", "-n", "2", *SMALL], "-n 2 contradicts SLURM_NTASKS=4 from SLURM",
              env={"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"})
        os.makedirs(self.path("bad"))
        with open(self.path("bad/last.ckpt"), "wb") as f:
            f.write(b"SHRDCKPT" + b"\0" * 40)
        fails(["train", "-n", "2", *SMALL, "--checkpoint-dir", self.path("bad"), "--resume"],
              f"checkpoint '{self.path('bad')}/last.ckpt'", ranks=2)
        # Numbers out of range, options that need another, paths of the wrong kind: one line at once.
        for option, value, needle in [("-n", "0", "--nproc: must be positive, got 0"),
                                      ("--train-samples", "-5", "--train-samples: must be non-negative, got -5"),
                                      ("--clip", "-1", "--clip: must be non-negative, got -1"),
                                      ("--weight-decay", "-0.1", "--weight-decay: must be non-negative, got -0.1"),
                                      ("--warmup-steps", "-3", "--warmup-steps: must be non-negative"),
                                      ("--stop-after-steps", "-1", "--stop-after-steps: must be non-negative"),
                                      ("--timeout", "0", "--timeout: must be positive, got 0"),
                                      ("--threads", "5000", "--threads: must be from 0 to 1024, got 5000"),
                                      ("--seed", "-1", "--seed: must be an integer from 0 to"),
                                      ("--checkpoint-every", "5", "--checkpoint-every requires --checkpoint-dir")]:
            fails(["train", option, value], needle)
        fails(["train", "--sharded-checkpoint"], "--sharded-checkpoint requires --checkpoint-dir")
        fails(["train", "--gradient-wire", "fp8"], "fp8")
        fails(["train", "--param-wire", "fp8"], "fp8")
        fails(["train", "-n", "2", "--param-wire", "bf16", "--mixed-precision", "fp16", *SMALL],
              "param_wire(Wire::kBFloat16) with MixedPrecision::param_dtype(kHalf)", ranks=2)
        fails(["train", "-n", "2", "--error-feedback", *SMALL], "error_feedback(true) needs a compressed gradient_wire",
              ranks=2)
        fails(["train", "-n", "2", "--step-in-backward", "on", "--clip", "1", *SMALL],
              "--step-in-backward on cannot go with --clip", ranks=2)
        fails(["train", "-n", "2", "--overlap-sync", "on", "--survive-failures", *SMALL],
              "--overlap-sync on cannot go with --survive-failures", ranks=2)
        fails(["train", "--overlap-sync", "sometimes"], "sometimes")
        # The environment's switches: a malformed value is one line naming the variable and what it takes.
        for value in ("1", "1:x", "-1:5", "1:5:"):
            fails(["train", "-n", "2", *SMALL], f"SHARDOPT_FAULT_AT_STEP='{value}' is not RANK:STEP", ranks=2,
                  env={"SHARDOPT_FAULT_AT_STEP": value})
        fails(["train", "-n", "2", *SMALL], "SHARDOPT_FUSED_KERNELS='avx3' is not one of default, avx2, avx512",
              ranks=2, env={"SHARDOPT_FUSED_KERNELS": "avx3"})
        fails(["train", "--data", EXE], f"--data '{EXE}' is not a folder")
        fails(["train", *SMALL, "--checkpoint-dir", EXE], f"--checkpoint-dir '{EXE}' is not a folder")

    def test_resuming_with_other_options_names_the_option(self):
        def tiny(samples="256", batch="64"):
            return ["--epochs", "1", "--train-samples", samples, "--test-samples", "100", "--batch-size", batch]
        run(["train", *tiny(), "--optimizer", "sgd", "--lr", "0.05", "--checkpoint-dir", self.dir])
        ckpt = f"checkpoint '{self.dir}/last.ckpt' was written with"
        for args, needle in [(tiny() + ["--optimizer", "adam"], f"{ckpt} --optimizer sgd; resume it with --optimizer sgd"),
                             (tiny() + ["--optimizer", "sgd", "--mixed-precision", "bf16"],
                              f"{ckpt} --mixed-precision off"),
                             (tiny(batch="32") + ["--optimizer", "sgd"], f"{ckpt} --batch-size 64; this run has 32"),
                             (tiny() + ["--optimizer", "sgd", "--model", "vit"],
                              f"{ckpt} --model cnn; resume it with --model cnn (this run has vit)"),
                             (tiny(samples="320") + ["--optimizer", "sgd"], "written for 256 training images")]:
            p = run(["train", *args, "--checkpoint-dir", self.dir, "--resume"], check=False)
            self.assertNotEqual(p.returncode, 0, args)
            lines = [l for l in p.stderr.splitlines() if l.strip()]
            self.assertEqual(len(lines), 1, p.stderr)
            self.assertIn(needle, lines[0])
        p = run(["train", *tiny(), "--optimizer", "sgd", "--lr", "0.05", "--checkpoint-dir", self.dir, "--resume"])
        self.assertIn("resumed from", p.stdout)
        self.assertNotIn("resumed with", p.stdout)
        # Hyperparameters may differ: the command line's values are in effect, every one of them
        # (weight decay too, which the checkpoint's param groups carry), and rank 0 says, one line
        # each, which differ from the checkpoint's.
        longer = ["--epochs", "2", *tiny()[2:], "--optimizer", "sgd", "--lr", "0.05", "--weight-decay", "0.01",
                  "--freeze", "conv@s6"]
        p = run(["train", *longer, "--checkpoint-dir", self.dir, "--resume"])
        said = [l for l in p.stdout.splitlines() if l.startswith("resumed with")]
        self.assertEqual(said, ["resumed with --weight-decay 0.01 (the checkpoint was written with 0): this run's "
                                "value is in effect",
                                "resumed with --epochs 2 (the checkpoint was written with 1): this run's value is in "
                                "effect",
                                "resumed with another --freeze/--unfreeze schedule than the checkpoint was written "
                                "with: this run's is in effect"], p.stdout)
        groups = read_checkpoint.load(f"{self.dir}/last.ckpt")["optimizer"]["param_groups"]
        self.assertEqual([g["weight_decay"] for g in groups], [0.01] * len(groups))

    def test_memory_report_measures_one_worldth(self):
        out = self.path("mem")
        p = run(["memory", "--preset", "cnn", "--world-sizes", "1,2,4", "--steps", "2", "-o", out])
        self.assertIn("zero2", p.stdout)
        with open(os.path.join(out, "memory.json")) as f:
            report = json.load(f)
        rows = report["rows"]
        def value(mode, world, field, scenario="all trainable"):
            return [r[field] for r in rows if r["mode"] == mode and r["world"] == world and r["scenario"] == scenario]
        state1 = value("ddp", 1, "state")[0]
        grads1 = value("ddp", 1, "grads")[0]
        self.assertGreater(state1, 0)
        for world in (2, 4):
            for mode in ("zero1", "zero2"):
                for s in value(mode, world, "state"):
                    self.assertAlmostEqual(s / (state1 / world), 1.0, delta=0.03, msg=f"{mode} world {world}")
            for g in value("zero2", world, "grads"):
                self.assertAlmostEqual(g / (grads1 / world), 1.0, delta=0.03, msg=f"zero2 grads world {world}")
            for g in value("ddp", world, "grads"):
                self.assertEqual(g, grads1)
        self.assertTrue(any(r["scenario"].endswith("frozen") for r in rows))
        # After the freeze every rank still holds its share of all the state, the frozen layers'
        # kept state included, and the tool prints it per rank.
        for world in (2, 4):
            for mode in ("zero1", "zero2"):
                frozen = [r["state"] for r in rows if r["mode"] == mode and r["world"] == world and r["scenario"].endswith("frozen")]
                self.assertEqual(len(frozen), world)
                for s in frozen:
                    self.assertAlmostEqual(s / (sum(frozen) / world), 1.0, delta=0.03, msg=f"{mode} world {world} frozen: {frozen}")
        self.assertIn("optimizer state per rank", p.stdout)
        # The peak by phase (Note [Peaks by phase]): each phase's rise above where it began is within
        # the run's peak, zero2's exchange (no all-reduce: nothing runs in it) rises by nothing, the
        # re-partition rises only after the freeze, and what stays resident after the step (malloc's
        # free memory in it) is under the peak.
        for r in rows:
            what = f"{r['mode']} world {r['world']} {r['scenario']} rank {r['rank']}"
            for phase in ("forward", "backward", "exchange", "step", "rebuild"):
                self.assertGreaterEqual(r[f"rise_{phase}"], 0, what)
                self.assertLess(r[f"rise_{phase}"], r["peak_rss"], what)
            if r["mode"] == "zero2":
                self.assertLess(r["rise_exchange"], 1 << 20, what)
            if r["scenario"] == "all trainable":
                self.assertEqual(r["rise_rebuild"], 0, what)
            self.assertLessEqual(r["rss_after_step"], r["peak_rss"], what)
            self.assertGreaterEqual(r["malloc_free"], 0, what)
            self.assertLess(r["malloc_free"], r["rss_after_step"], what)
        with open(os.path.join(out, "memory.csv")) as f:
            self.assertEqual(len(list(csv.DictReader(f))), len(rows))
        with open(os.path.join(out, "memory.png"), "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_memory_report_of_a_json_spec(self):
        spec = self.path("spec.json")
        with open(spec, "w") as f:
            json.dump({"layers": [{"name": "embed", "shape": [1000, 64]}, {"name": "fc", "shape": [64, 64]},
                                  {"shape": [64]}]}, f)
        out = self.path("mem")
        run(["memory", "--spec", spec, "--world-sizes", "1,2", "--modes", "zero2,zero2-bf16", "--steps", "1", "-o", out,
             "--no-chart"])
        with open(os.path.join(out, "memory.json")) as f:
            report = json.load(f)
        n = report["numel"]
        self.assertEqual(n, 1000 * 64 + 64 * 64 + 64)
        rows = [r for r in report["rows"] if r["scenario"] == "all trainable"]
        one = [r for r in rows if r["world"] == 1 and r["mode"] == "zero2"][0]
        self.assertEqual(one["state"], 8 * n)  # exp_avg and exp_avg_sq, fp32
        # Mixed precision: bf16 parameters everywhere, fp32 master + Adam state (12 bytes) and bf16
        # gradients (2 bytes) over the world size on every rank.
        for r in (r for r in rows if r["mode"] == "zero2-bf16"):
            self.assertEqual(r["params"], 2 * n)
            self.assertAlmostEqual(r["state"] / (12 * n / r["world"]), 1.0, delta=0.03, msg=str(r))
            self.assertAlmostEqual(r["grads"] / (2 * n / r["world"]), 1.0, delta=0.03, msg=str(r))
        # Muon on the matrix that is not an embedding (fc): one fp32 momentum buffer, 4 bytes per
        # element, against Adam's 8 on the rest; ddp holds it all, zero1 half per rank.
        run(["memory", "--spec", spec, "--world-sizes", "1,2", "--modes", "ddp,zero1", "--steps", "1",
             "--optimizer", "muon", "-o", out, "--no-chart"])
        with open(os.path.join(out, "memory.json")) as f:
            report = json.load(f)
        muon_state = 4 * 64 * 64 + 8 * (1000 * 64 + 64)
        for r in (r for r in report["rows"] if r["scenario"] == "all trainable"):
            self.assertEqual(r["formula"]["state"], muon_state if r["mode"] == "ddp" else muon_state / r["world"], str(r))
            if r["mode"] == "ddp" or r["world"] == 1:
                self.assertEqual(r["state"], muon_state, str(r))
        two = [r["state"] for r in report["rows"] if r["scenario"] == "all trainable" and r["mode"] == "zero1"
               and r["world"] == 2]
        self.assertEqual(sum(two), muon_state)
        with open(spec, "w") as f:
            f.write('{"layers": [{"shape": [3, -1]}]}')
        p = run(["memory", "--spec", spec], check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertIn("layer 0 ('layer0') has a dimension that is not a positive integer", p.stderr)


if __name__ == "__main__":
    unittest.main()
