"""The ceilings measured on the H200 that every floor of the benchmarks is computed against.

Measured on one H200 (141 GB HBM3e): a device-to-device copy moves 4.3 TB/s (bytes read plus
bytes written), a bf16 GEMM reaches 790 TF/s and an fp8 ``torch._scaled_mm`` 1365 TF/s. Under
sustained tensor-core work the board holds its power limit by lowering its SM clock, so a long
run may not reach 790 TF/s (notebook 06 scales it by the clock that nvidia-smi logged).

``moekit.roofline.layer_floor(shape, M, unique, quant, ceilings=H200)`` is the floor the harness,
the GPU checks, the anchors and notebook 06 set beside each measurement.
"""

from __future__ import annotations

from moekit.roofline import Ceilings
from moekit.types import QuantScheme

H200 = Ceilings(
    name="H200",
    bandwidth=4.3e12,  # bytes/s, device copy (read + write)
    flops={QuantScheme.NONE: 790e12, QuantScheme.FP8_BLOCK: 1365e12},  # bf16 GEMM; fp8 block torch._scaled_mm
)
