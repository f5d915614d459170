"""Energy beside time: joules per forward and per useful flop, moekit against triton_kernels.

The H200 runs large-M GEMMs at its power cap, where the SM clock (and so the time) follows the
power: a kernel that takes longer per cycle also spends more energy per useful flop. This runs
each peer's whole layer back to back for ``--seconds`` per round (rounds alternate the peers, so
neither is favoured by the card warming up), reading the GPU's energy counter (NVML's total energy,
in mJ, when ``pynvml`` imports) or else integrating ``nvidia-smi`` power samples every 50 ms::

    PYTHONPATH=.:third_party/triton_kernels-3.6 python -m benchmarks.research.gpu_energy \\
        [--M 16384] [--peers triton_fused,triton_kernels] [--seconds 3] [--rounds 3] [--out DIR]

Useful flops are the layer's own (``moekit.roofline.layer_floor``: 2 x M x topk x the GEMMs' MACs);
the result is pJ per useful flop (1 pJ/flop is 1 µJ per MFLOP) and mean watts, per round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.ceilings import H200
from benchmarks.harness import measure
from benchmarks.harness.peers import make_peer
from benchmarks.harness.problem import build_problem
from moekit import roofline
from moekit.types import QuantScheme


class EnergyMeter:
    """Joules spent by GPU 0 between :meth:`start` and :meth:`stop`: NVML's counter, or power samples."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle, self._nvml = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml
            self.source = "NVML total energy counter"
        except Exception:  # no pynvml: sample the power instead
            self._nvml, self.source = None, "nvidia-smi power.draw every 50 ms, integrated"
            if shutil.which("nvidia-smi") is None:
                raise SystemExit("no pynvml and no nvidia-smi: nothing reports this GPU's energy") from None

    def start(self) -> None:
        if self._nvml is not None:
            self._mj = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            return
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
        cmd = ["nvidia-smi", "--query-gpu=power.draw", "--format=csv,noheader,nounits", "-lms", "50"]
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.DEVNULL)
        time.sleep(0.2)

    def stop(self, seconds: float) -> float:
        if self._nvml is not None:
            return (self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._mj) / 1000
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self._log.seek(0)
        watts = [float(x) for x in self._log.read().split() if x.replace(".", "", 1).isdigit()]
        self._log.close()
        return statistics.fmean(watts) * seconds


def run_for(call, seconds: float) -> tuple[int, float]:
    """Forwards done back to back in about ``seconds`` (synchronized every 20), and the exact time."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            call()
        n += 20
        torch.cuda.synchronize()
    return n, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.research.gpu_energy")
    ap.add_argument("--shape", default="qwen3_30b_a3b")
    ap.add_argument("--M", type=int, default=16384)
    ap.add_argument("--peers", default="triton_fused,triton_kernels")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    shape = roofline.get_shape(args.shape)
    problem = build_problem(shape, args.M, "bf16", seed=args.M, device="cuda")
    unique = int(torch.unique(problem.topk_ids).numel())
    flops = roofline.layer_floor(shape, args.M, unique, QuantScheme.NONE, ceilings=H200).flops
    meter = EnergyMeter()
    peers = [make_peer(name, "bf16") for name in args.peers.split(",")]
    result = {"gpu": torch.cuda.get_device_name(), "shape": args.shape, "M": args.M, "useful_flops": flops,
              "source": meter.source, "rows": []}  # fmt: skip
    for peer in peers:
        if peer.skipped:
            raise SystemExit(f"{peer.name}: {peer.skipped}")
        run_for(lambda p=peer: p.run(problem), 1.0)  # compiled and warm
    for r in range(args.rounds):
        for peer in peers if r % 2 == 0 else peers[::-1]:
            meter.start()
            n, seconds = run_for(lambda p=peer: p.run(problem), args.seconds)
            joules = meter.stop(seconds)
            row = {"peer": peer.name, "round": r, "forwards": n, "us_per_forward": seconds / n * 1e6,
                   "watts": joules / seconds, "mJ_per_forward": joules / n * 1e3,
                   "pJ_per_useful_flop": joules / n / flops * 1e12}  # fmt: skip
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    for peer in peers:
        mine = [r for r in result["rows"] if r["peer"] == peer.name]
        summary = {k: statistics.median(r[k] for r in mine) for k in ("us_per_forward", "watts", "pJ_per_useful_flop")}
        print(peer.name, "median:", json.dumps(summary), flush=True)
        result[peer.name] = summary
    measure.synchronize()
    out = Path(args.out) / f"energy-{args.shape}-M{args.M}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out} ({meter.source})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
