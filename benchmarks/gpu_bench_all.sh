#!/usr/bin/env bash
# All of moekit's benchmarks at the performance issue's shapes, in one call on one H200:
#
#     bash benchmarks/gpu_bench_all.sh     # JSON + log.txt in $OUT (else benchmarks/results)
#
# Steps run in priority order, each in its own process under `timeout`, and the whole run stops
# starting new steps near BUDGET_S seconds (default 470, so it ends inside a 10-minute call).
# Every step rewrites its JSON after each row, so a step cut short keeps what it measured.
# It writes at most 8 files into $OUT: log.txt, 6 JSON files and clocks.csv (SM clock and board
# power every 250 ms: under sustained GEMMs the H200 sits at its power limit, below top clock).
# No install and no network: moekit and benchmarks run from this checkout through PYTHONPATH.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
BUDGET_S="${BUDGET_S:-470}"
PY="${PYTHON:-python3}"
START=$(date +%s)
: >"$LOG"

say() { echo "$*" | tee -a "$LOG"; }

# step NAME MAX_SECONDS COMMAND...: run unless fewer than 20 s of the budget are left.
step() {
    local name=$1 max=$2
    shift 2
    local left=$((BUDGET_S - ($(date +%s) - START)))
    local limit=$((max < left ? max : left))
    if ((limit < 20)); then
        say "== SKIPPED $name: ${left}s of the ${BUDGET_S}s budget left"
        return
    fi
    say ""
    say "== $name (limit ${limit}s, $(($(date +%s) - START))s elapsed): $*"
    local t0=$(date +%s)
    timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local note=""
    ((rc == 124)) && note=" (TIMED OUT: rows so far are in its JSON)"
    say "== $name: exit $rc after $(($(date +%s) - t0))s$note"
}

say "moekit GPU benchmarks, $(date -u +%FT%TZ), budget ${BUDGET_S}s, results in $OUT"
CLOCKS_PID=""
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 250 \
        >"$OUT/clocks.csv" 2>/dev/null &
    CLOCKS_PID=$!
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>&1 | tee -a "$LOG"
step info 30 "$PY" -c "
import torch, triton, numpy, moekit
from moekit.backends.deep_gemm import status
print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__,
      'device', moekit.device.get_device(), torch.cuda.get_device_name())
print('torch._grouped_mm:', hasattr(torch, '_grouped_mm'), '| deep_gemm:', status())"

# 1. The main target table: Qwen3-30B-A3B bf16, every M eager and as a CUDA graph (so a slow
#    host shows as eager > graph instead of hiding in the kernel numbers), profiler split for all,
#    and the same kernel through GraphedKernel (an eager call that replays a graph).
step layer-qwen3-bf16 180 "$PY" -m benchmarks.harness layer --shape qwen3_30b_a3b --dtype bf16 \
    --M 1 128 4096 16384 32768 --graph-max-M 32768 --peers grouped_mm,triton,triton_fused,triton_graphed --phases \
    --out "$OUT"

# 2. Chunking cost and workspace bytes against C.
step chunking-qwen3 75 "$PY" -m benchmarks.harness chunking --shape qwen3_30b_a3b --dtype bf16 --M 16384 \
    --C 256 512 1024 2048 4096 None --out "$OUT"

# 3. DeepSeek-V3-like bf16 at M=16384 (target <= 18 ms; 22.5 GB of weights).
step layer-dsv3-bf16 100 "$PY" -m benchmarks.harness layer --shape deepseek_v3 --dtype bf16 --M 16384 \
    --peers grouped_mm,triton,triton_chunked --phases --check-rows 128 --out "$OUT"

# 4. fp8 block, DeepSeek-V3-like, M=4096: GEMM TF/s and the non-GEMM share per experts backend.
step layer-dsv3-fp8 100 "$PY" -m benchmarks.harness layer --shape deepseek_v3 --dtype fp8 --M 4096 \
    --peers triton,deep_gemm_triton,deep_gemm --phases --check-rows 128 --out "$OUT"

# 5. The count kernel (its own subcommand; 262144 x 8 ids, E=256 is the target row).
step count 45 "$PY" -m benchmarks.harness count --graph --out "$OUT"

# 6. fp8 block, Qwen3 shape, M=4096 (vLLM Triton anchor 1647 us).
step layer-qwen3-fp8 60 "$PY" -m benchmarks.harness layer --shape qwen3_30b_a3b --dtype fp8 --M 4096 \
    --peers triton,deep_gemm_triton,deep_gemm --phases --out "$OUT"

say ""
say "== summary ($(($(date +%s) - START))s elapsed)"
"$PY" benchmarks/bench_summary.py "$OUT" 2>&1 | tee -a "$LOG"
if [ -n "$CLOCKS_PID" ]; then
    kill "$CLOCKS_PID" 2>/dev/null
    # Samples above 400 W are the loaded ones: their mean clock is what the GEMMs ran at.
    awk -F', ' 'NR > 1 { split($2, c, " "); split($3, p, " ");
        if (p[1] > 400) { clk += c[1]; pw += p[1]; n++ } }
        END { if (n) printf "clocks under load (>400 W): %d samples, mean %.0f MHz, %.0f W\n", n, clk / n, pw / n }' \
        "$OUT/clocks.csv" | tee -a "$LOG"
fi
