"""`shardopt plan`, run as a user runs it: its bytes against what `shardopt memory` measures on
real ranks, the ZeRO paper's formula where the layout adds nothing, a 70B shape at 4,096 ranks,
and bad input.

Run by ctest with the project's Python; SHARDOPT_EXE names the executable.
"""
import csv
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import unittest

EXE = os.environ["SHARDOPT_EXE"]


def run(args, check=True, timeout=600, chart=False):
    """`shardopt ARGS`; `memory` and `plan` draw no chart (a second or two of matplotlib) unless `chart`."""
    if args and args[0] in ("memory", "plan") and not chart:
        args = [*args, "--no-chart"]
    p = subprocess.run([EXE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"shardopt {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


def zero_formula(mode, world, numel):
    """The ZeRO paper's bytes per rank for Adam, computed here independently of the plan: parameters
    and gradients in the parameters' precision (ZeRO-2 shards the gradients); exp_avg and exp_avg_sq
    (8 bytes an element), with an fp32 master beside them under bf16 (12), sharded by ZeRO-1 and 2."""
    low = 2 if mode.endswith("-bf16") else 4
    zero2 = mode.startswith("zero2")
    state = (12 if low == 2 else 8) * numel
    return {"params": low * numel,
            "grads": low * numel / world if zero2 else low * numel,
            "state": state if mode == "ddp" else state / world}


# A model whose shapes make the layout do work: matrices and vectors of odd sizes (alignment, split
# pieces, buckets), an embedding, and enough tensors that whole parameters do not balance. Freezing
# half of it freezes the leading layers up to the embedding (a third of the elements).
SPEC = {"layers": [{"name": f"h{i}.w", "shape": [48 + 8 * (i % 3), 48]} for i in range(9)] +
        [{"name": f"h{i}.b", "shape": [48 + 8 * (i % 3)]} for i in range(9)] +
        [{"name": "emb", "shape": [997, 48]}, {"name": "head", "shape": [10, 48]}]}


class PlanTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="shardopt-plan-")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def compare(self, args, modes, optimizer):
        """Every rank's bytes in `plan.csv` equal `shardopt memory`'s, in every mode, world size and scenario."""
        common = [*args, "--world-sizes", "1,2,4", "--modes", modes, "--optimizer", optimizer,
                  "--freeze-fraction", "0.5"]
        memory = run(["memory", *common, "--steps", "2", "-o", self.path("memory")])
        plan = run(["plan", *common, "-o", self.path("plan")])
        # (--no-chart: the JSON and the CSV only.)
        self.assertIn(f"wrote {self.path('memory')}/memory.json and memory.csv", memory.stdout)
        self.assertRegex(plan.stdout, rf"wrote {re.escape(self.path('plan'))}/plan.json and plan.csv\n")
        self.assertFalse(os.path.exists(self.path("memory/memory.png")) or os.path.exists(self.path("plan/plan.png")))
        with open(self.path("memory/memory.json")) as f:
            measured = json.load(f)["rows"]
        with open(self.path("plan/plan.csv")) as f:
            planned = {(r["mode"], int(r["world"]), r["scenario"], int(r["rank"])): r for r in csv.DictReader(f)}
        self.assertEqual(len(measured), len(planned))
        self.assertEqual(len(measured), sum(w for w in (1, 2, 4)) * len(modes.split(",")) * 2)
        for m in measured:
            p = planned[(m["mode"], m["world"], m["scenario"], m["rank"])]
            what = f"{optimizer} {m['mode']} world {m['world']} {m['scenario']} rank {m['rank']}"
            self.assertEqual(float(p["params"]), m["params"], what)
            self.assertEqual(float(p["grads"]), m["grads"], what)
            self.assertEqual(float(p["buckets"]), m["buckets"], what)
            # memory counts fp32 masters as state, as ZeRO's 12 bytes do
            self.assertEqual(float(p["state"]) + float(p["masters"]), m["state"], what)
            self.assertEqual(float(p["feedback"]), m["feedback"], what)
        return measured

    def test_plan_equals_memory_on_real_ranks(self):
        spec = self.path("spec.json")
        with open(spec, "w") as f:
            json.dump(SPEC, f)
        rows = self.compare(["--spec", spec], "ddp,zero1,zero2,zero1-bf16,zero2-bf16", "adam")
        # The freeze froze something.
        frozen = [r for r in rows if r["mode"] == "zero1" and r["world"] == 4 and r["scenario"] != "all trainable"]
        self.assertEqual(len(frozen), 4)
        self.assertEqual(frozen[0]["scenario"], "34% frozen")
        # Muon keeps its matrices whole on owners balanced by cost, Adam splits the rest: the ranks
        # hold different amounts of state, so the comparison covers placements that are not even.
        # bf16 state (--state-format bf16): Adam's two moments in 2 bytes each instead of 4, and under
        # zero2-bf16 the fp32 masters beside them (memory counts them as state): 8 bytes of 12.
        bf16 = self.compare(["--spec", spec, "--state-format", "bf16"], "zero2,zero2-bf16", "adam")
        fp32 = {(r["mode"], r["world"], r["scenario"], r["rank"]): r["state"] for r in rows}
        for r in bf16:
            full = fp32[(r["mode"], r["world"], r["scenario"], r["rank"])]
            self.assertGreater(full, 0, r)
            self.assertEqual(r["state"] * (3 if r["mode"].endswith("bf16") else 4), full * 2, r)
        # int8 state (--state-format int8): the embedding (47,856 elements) in codes, a byte an element
        # and 4 bytes a block of 256, the smaller tensors in fp32; plan and memory lay the state out
        # aligned to 256 elements alike. Summed over the ranks, about half the fp32 state's bytes.
        int8 = self.compare(["--spec", spec, "--state-format", "int8"], "zero2", "adam")
        for world, scenario in {(r["world"], r["scenario"]) for r in int8}:
            ours = sum(r["state"] for r in int8 if (r["world"], r["scenario"]) == (world, scenario))
            full = sum(fp32[k] for k in fp32 if k[0] == "zero2" and (k[1], k[2]) == (world, scenario))
            self.assertLess(ours, 0.55 * full, (world, scenario))
            self.assertGreater(ours, 0.45 * full, (world, scenario))
        muon = self.compare(["--spec", spec], "zero1,zero2", "muon")
        states = {r["state"] for r in muon if r["mode"] == "zero2" and r["world"] == 4}
        self.assertGreater(len(states), 1, muon)
        # The CNN that `shardopt train` trains, with error feedback on an int8 wire: its residuals,
        # bf16, one per element each rank sends (every trainable element and the row gaps), on
        # every rank, apart from the 1/N gradients.
        cnn = self.compare(["--preset", "cnn", "--gradient-wire", "int8", "--error-feedback"], "zero2,zero2-bf16", "adam")
        for r in cnn:
            if r["world"] == 1:  # one rank sends nothing
                self.assertEqual(r["feedback"], 0, r)
                continue
            same = [q for q in cnn if (q["mode"], q["world"], q["scenario"]) == (r["mode"], r["world"], r["scenario"])]
            trainable = sum(q["grads"] for q in same) / (2 if r["mode"].endswith("bf16") else 4)
            self.assertGreaterEqual(r["feedback"], 2 * trainable, r)
            self.assertLessEqual(r["feedback"], 1.25 * 2 * trainable, r)

    def test_plan_equals_the_zero_formula_where_the_layout_adds_nothing(self):
        # One rank: no padding, no imbalance, on a real model.
        run(["plan", "--preset", "gpt2-small", "--world-sizes", "1", "--modes", "zero1,zero2", "-o", self.path("p")],
            chart=True)
        with open(self.path("p/plan.json")) as f:
            report = json.load(f)
        n = report["numel"]
        self.assertEqual(n, 124439808)
        for c in report["configs"]:
            r, f = c["max_rank"], zero_formula(c["mode"], 1, n)
            self.assertEqual(c["formula"], f, c)
            self.assertEqual(r["params"], f["params"], c)
            self.assertEqual(r["grads"], f["grads"], c)
            self.assertEqual(r["state"] + r["masters"], f["state"], c)
            # What the formula leaves out: DDP's all-reduce bucket beside ZeRO-1, ZeRO-2's counts
            if c["mode"] == "zero1":
                self.assertEqual(r["buckets"], r["grads"], c)
            else:
                self.assertLess(r["buckets"], 1e-4 * r["grads"], c)
            self.assertTrue(c["against_formula"].endswith(" buckets"), c)
            self.assertNotIn(",", c["against_formula"], c)
            # One rank moves nothing.
            self.assertEqual(r["bytes_sent_per_step"], 0, c)
            self.assertEqual(r["bytes_received_per_step"], 0, c)
        self.assertTrue(os.path.getsize(self.path("p/plan.png")) > 10000)
        with open(self.path("p/plan.png"), "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

        # Several ranks, where the layout adds nothing either: 8 equal matrices, so at 2, 4 and 8 ranks
        # the rows of the one row bucket end where matrices end, every shard is exactly 1/W
        # of the model with no padding, and every rank must hold exactly the paper's bytes and move
        # exactly its traffic. The numbers come from the formula computed here (zero_formula above),
        # not from the plan's own "formula" field, and every rank is checked, not only the busiest.
        shape = [96, 64]
        layers = 8
        spec = self.path("equal.json")
        with open(spec, "w") as f:
            json.dump({"layers": [{"name": f"h{i}.w", "shape": shape} for i in range(layers)]}, f)
        worlds = (2, 4, 8)
        modes = ("ddp", "zero1", "zero2", "zero1-bf16", "zero2-bf16")
        run(["plan", "--spec", spec, "--world-sizes", ",".join(map(str, worlds)), "--modes", ",".join(modes),
             "--optimizer", "adam", "-o", self.path("q")])
        n = layers * shape[0] * shape[1]
        with open(self.path("q/plan.json")) as f:
            report = json.load(f)
        self.assertEqual(report["numel"], n)
        configs = {(c["mode"], c["world_size"]): c for c in report["configs"]}
        with open(self.path("q/plan.csv")) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(len(rows), len(modes) * sum(worlds))
        for row in rows:
            mode, w = row["mode"], int(row["world"])
            what = f"{mode} world {w} rank {row['rank']}"
            c = configs[(mode, w)]
            f = zero_formula(mode, w, n)
            self.assertEqual(c["formula"], f, c)
            if mode != "ddp":
                self.assertTrue(c["split"], c)  # row buckets (Adam), whose rows hold whole matrices here
                self.assertEqual(c["layout_imbalance"], 0, c)
            self.assertEqual(float(row["params"]), f["params"], what)
            self.assertEqual(float(row["grads"]), f["grads"], what)
            self.assertEqual(float(row["state"]) + float(row["masters"]), f["state"], what)
            low = 2 if mode.endswith("-bf16") else 4
            self.assertEqual(float(row["masters"]), 4 * n / w if low == 2 else 0, what)
            # Beside the formula: DDP's and ZeRO-1's all-reduce bucket holds every gradient; ZeRO-2
            # keeps one row bucket (the model is far below --bucket-mb), whose slab adds one count per
            # piece in the rank's row (one per whole matrix it owns), rounded up to 16 elements.
            if mode.startswith("zero2"):
                self.assertEqual(c["buckets"], 1, c)
                share = n // w
                slab = -(-(share + layers // w) // 16) * 16
                self.assertEqual(float(row["buckets"]), low * (slab - share), what)
            else:
                self.assertEqual(float(row["buckets"]), low * n, what)
            # Traffic per step, the paper's: ZeRO-2 reduce-scatters every gradient to its owner and
            # all-gathers the parameters back, (W-1)/W of the model's bytes each, both ways; DDP
            # all-reduces them, 2(W-1)/W; ZeRO-1 all-reduces and then all-gathers, 3(W-1)/W.
            times = {"ddp": 2, "zero1": 3, "zero2": 2}[mode.split("-")[0]]
            expected = times * (w - 1) * low * n / w
            for key in ("sent", "received"):
                self.assertEqual(float(row[f"{key}_within_block"]), expected, f"{what} {key}")
                self.assertEqual(float(row[f"{key}_across_blocks"]), 0, f"{what} {key}")

    def test_a_70b_shape_plans_at_4096_ranks(self):
        run(["plan", "--preset", "llama-70b", "--world-sizes", "4096", "--modes", "zero1,zero2,zero2-bf16", "-o",
             self.path("p")])
        with open(self.path("p/plan.json")) as f:
            report = json.load(f)
        n = report["numel"]
        self.assertEqual(n, 68976648192)
        for c in report["configs"]:
            self.assertTrue(c["split"], c)
            ideal = (12 if c["mode"].endswith("bf16") else 8) * n / 4096
            busiest = c["max_rank"]["state"] + c["max_rank"]["masters"]
            # 1/4096 of the total, plus at most one element of padding per rank
            self.assertGreaterEqual(busiest, ideal)
            self.assertLessEqual(busiest, 1.01 * ideal, c)
            # Per step every rank sends and receives about the model's bytes twice under ZeRO-2 (a
            # reduce to each owner, a broadcast from it), three times under ZeRO-1 (an all-reduce
            # of the gradients, then the broadcast)
            low = 2 if c["mode"].endswith("bf16") else 4
            times = 3 if c["mode"].startswith("zero1") else 2
            for key in ("bytes_sent_per_step", "bytes_received_per_step"):
                self.assertAlmostEqual(c["max_rank"][key] / (times * low * n), 1.0, delta=0.01, msg=c)
        with open(self.path("p/plan.csv")) as f:
            self.assertEqual(len(list(csv.DictReader(f))), 3 * 4096)

    def test_a_bf16_gradient_wire_halves_the_gradient_bytes_only(self):
        """--gradient-wire bf16: ZeRO-2's gradients travel in bf16, the parameter sync and the memory
        stay as they are. With row buckets the gradients' reduce-scatter and the parameters'
        all-gather move the same rows, so a rank sends and receives 3/4 of the exact wire's bytes;
        DDP and ZeRO-1 do not change."""
        common = ["plan", "--spec", self.path("spec.json"), "--world-sizes", "2,4,8", "--modes", "ddp,zero1,zero2",
                  "--partition", "split"]
        with open(self.path("spec.json"), "w") as f:
            json.dump(SPEC, f)
        run([*common, "-o", self.path("exact")])
        run([*common, "--gradient-wire", "bf16", "-o", self.path("bf16")])
        plans = {}
        for wire in ("exact", "bf16"):
            with open(self.path(f"{wire}/plan.json")) as f:
                plans[wire] = {(c["mode"], c["world_size"]): c for c in json.load(f)["configs"]}
        self.assertEqual(plans["exact"].keys(), plans["bf16"].keys())
        for key, exact in plans["exact"].items():
            bf16 = plans["bf16"][key]
            self.assertEqual(bf16["gradient_wire"], "bf16")
            for field in ("params", "grads", "buckets", "masters", "state"):
                self.assertEqual(bf16["max_rank"][field], exact["max_rank"][field], key)
            self.assertEqual(bf16["collectives_per_step"], exact["collectives_per_step"], key)
            for field in ("bytes_sent_per_step", "bytes_received_per_step"):
                want = 0.75 * exact["max_traffic_rank"][field] if key[0] == "zero2" else exact["max_traffic_rank"][field]
                self.assertAlmostEqual(bf16["max_traffic_rank"][field], want, delta=1e-6 * want + 1e-9, msg=str(key))
            if key[0] == "zero2":
                self.assertLess(bf16["comm_seconds_per_step"], exact["comm_seconds_per_step"], key)
        p = run(["plan", "--gradient-wire", "fp8"], check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("--gradient-wire", p.stderr)

    def test_a_bf16_param_wire_halves_the_sync_and_adds_the_masters(self):
        """--param-wire bf16: the parameter sync travels in bf16 and the owners keep fp32 masters
        (4 bytes per owned element, the same as the state's one moment). With row buckets the sync
        is half of ZeRO-2's bytes, so a rank moves 3/4 of the exact wire's, and 1/2 with both wires;
        ZeRO-1's all-reduce moves twice the sync's bytes, so it moves about 5/6; DDP does not change."""
        common = ["plan", "--spec", self.path("spec.json"), "--world-sizes", "2,4,8", "--modes", "ddp,zero1,zero2",
                  "--partition", "split"]
        with open(self.path("spec.json"), "w") as f:
            json.dump(SPEC, f)
        run([*common, "-o", self.path("exact")])
        run([*common, "--param-wire", "bf16", "-o", self.path("param")])
        run([*common, "--param-wire", "bf16", "--gradient-wire", "bf16", "-o", self.path("both")])
        plans = {}
        for wire in ("exact", "param", "both"):
            with open(self.path(f"{wire}/plan.json")) as f:
                plans[wire] = {(c["mode"], c["world_size"]): c for c in json.load(f)["configs"]}
        for key, exact in plans["exact"].items():
            param, both = plans["param"][key], plans["both"][key]
            self.assertEqual(param["param_wire"], "bf16")
            ddp = key[0] == "ddp"
            for field in ("params", "grads", "buckets", "state"):
                self.assertEqual(param["max_rank"][field], exact["max_rank"][field], key)
            # The masters: one fp32 value per owned element, half of Adam's fp32 state (8 bytes).
            want = 0 if ddp else exact["max_rank"]["state"] / 2
            self.assertAlmostEqual(param["max_rank"]["masters"], want, delta=1e-6 * want + 1e-9, msg=str(key))
            for field in ("bytes_sent_per_step", "bytes_received_per_step"):
                e = exact["max_traffic_rank"][field]
                ratio, delta = {"ddp": (1.0, 1e-6), "zero1": (2.5 / 3, 1e-2), "zero2": (0.75, 1e-6)}[key[0]]
                self.assertAlmostEqual(param["max_traffic_rank"][field], ratio * e, delta=delta * e + 1e-9, msg=str(key))
                if key[0] == "zero2":
                    self.assertAlmostEqual(both["max_traffic_rank"][field], 0.5 * e, delta=1e-6 * e + 1e-9, msg=str(key))
        # int8 on both wires: a byte an element and a 4-byte scale a block of 256, ZeRO-2's bytes
        # at (1 + 4/256) / 4 of the exact wires'.
        run([*common, "--param-wire", "int8", "--gradient-wire", "int8", "-o", self.path("int8")])
        with open(self.path("int8/plan.json")) as f:
            int8 = {(c["mode"], c["world_size"]): c for c in json.load(f)["configs"]}
        for key, exact in plans["exact"].items():
            if key[0] != "zero2":
                continue
            self.assertEqual(int8[key]["param_wire"], "int8")
            for field in ("bytes_sent_per_step", "bytes_received_per_step"):
                e = exact["max_traffic_rank"][field]
                self.assertAlmostEqual(int8[key]["max_traffic_rank"][field], (1 + 4 / 256) / 4 * e, delta=1e-6 * e + 1e-9,
                                       msg=str(key))
        p = run(["plan", "--param-wire", "fp8"], check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("--param-wire", p.stderr)

    def test_collectives_and_their_latency_per_step(self):
        """plan.json's collectives per step of the busiest rank, and the latency each adds to the
        communication time, computed here from NCCL's ring/Simple figures (8.4 us a collective, 3.4
        us a step inside a node, 14 us across nodes; 8 ranks a node): DDP's all-reduce of each of
        its buckets (PyTorch's defaults: a first of 1 MiB, then 25 MiB each; ring or tree, the
        faster), ZeRO-2's reduce-scatter and all-gather per bucket (rings), and with blocks of 8 the
        replica all-reduce of each bucket a rank owns."""
        run(["plan", "--preset", "gpt2-small", "--world-sizes", "8,64", "--modes", "ddp,zero2", "-o", self.path("p")])
        run(["plan", "--preset", "gpt2-small", "--world-sizes", "64", "--modes", "zero2", "--shard-group-size", "8",
             "-o", self.path("h")])
        configs = []
        for folder in ("p", "h"):
            with open(self.path(f"{folder}/plan.json")) as f:
                configs += json.load(f)["configs"]

        def chain(k, nodes):
            return (8.4 + (k - nodes) * 3.4 + (nodes - 1) * 14.0) * 1e-6

        def allreduce(k, nodes):
            ring = 8.4 + 2 * (k - nodes) * 3.4 + 2 * (nodes - 1) * 14.0
            tree = 8.4 + 2 * ((k / nodes - 1) * 3.4 + math.log2(nodes) * 14.0)
            return min(ring, tree) * 1e-6

        seen = set()
        for c in configs:
            w, mode, block = c["world_size"], c["mode"], c["shard_group_size"]
            seen.add((mode, w, block))
            self.assertGreater(c["comm_seconds_per_step"], c["latency_seconds_per_step"], c)
            if mode == "ddp":
                grad_bytes = 4 * c["trainable"]
                buckets = 1 + math.ceil(max(0, grad_bytes - 2**20) / (25 * 2**20))
                self.assertGreater(buckets, 1, c)
                self.assertEqual(c["collectives_per_step"], buckets, c)
                self.assertAlmostEqual(c["latency_seconds_per_step"], buckets * allreduce(w, (w + 7) // 8),
                                       delta=1e-12)
            elif block == 0:
                self.assertEqual(c["collectives_per_step"], 2 * c["buckets"], c)
                self.assertAlmostEqual(c["latency_seconds_per_step"], 2 * c["buckets"] * chain(w, (w + 7) // 8),
                                       delta=1e-9)
            else:
                # the busiest rank: the block's chains (one node), and an all-reduce over the 8
                # blocks (8 nodes) for each bucket it owns, at least its share of the buckets
                # (row buckets: every rank owns a row of each)
                owned = c["collectives_per_step"] - 2 * c["buckets"]
                if c["split"]:
                    self.assertEqual(owned, c["buckets"], c)
                else:
                    self.assertGreaterEqual(owned, c["buckets"] / 8, c)
                    self.assertLess(owned, c["buckets"], c)
                self.assertAlmostEqual(c["latency_seconds_per_step"],
                                       2 * c["buckets"] * chain(8, 1) + owned * allreduce(8, 8), delta=1e-9)
        self.assertEqual(seen, {("ddp", 8, 0), ("ddp", 64, 0), ("zero2", 8, 0), ("zero2", 64, 0), ("zero2", 64, 8)})
        # Latency grows with the world size: the same buckets' chains cross 8 nodes at 64 ranks.
        by = {(c["mode"], c["world_size"], c["shard_group_size"]): c for c in configs}
        self.assertGreater(by[("zero2", 64, 0)]["latency_seconds_per_step"],
                           by[("zero2", 8, 0)]["latency_seconds_per_step"])

    def test_bad_input_is_one_line_naming_it(self):
        spec = self.path("bad.json")
        with open(spec, "w") as f:
            f.write('{"layers": [{"shape": [3, ')
        cases = [
            (["--world-sizes", "12", "--shard-group-size", "8"], "--shard-group-size 8 does not divide the world size 12"),
            (["--preset", "gpt5"], "--preset 'gpt5' is not one of"),
            (["--spec", spec], "is not valid JSON"),
            (["--intra-node-bandwidth", "0"], "--intra-node-bandwidth: must be positive, got 0"),
            (["--inter-node-bandwidth", "-5"], "--inter-node-bandwidth: must be positive, got -5"),
            (["--world-sizes", "0"], "--world-sizes: must be positive, got 0"),
            (["--hop-latency-us", "-1"], "--hop-latency-us: must be non-negative, got -1"),
            (["--preset", "gpt2-small", "--freeze-fraction", "0.3"],
             "--freeze-fraction 0.3 freezes no layer: the first, 'wte', is alone more than that fraction"),
            (["--optimizer", "muon", "--state-format", "bf16"],
             "--state-format bf16 holds Adam's state, not Muon's; use --state-format fp32 or int8 with --optimizer muon"),
        ]
        for args, message in cases:
            p = run(["plan", *args, "-o", self.path("p")], check=False)
            self.assertNotEqual(p.returncode, 0, args)
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
            self.assertIn(message, p.stderr, args)


if __name__ == "__main__":
    unittest.main()
