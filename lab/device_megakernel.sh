#!/usr/bin/env bash
# One megakernel device call (correctness of the default kernel, then timing), under 7 minutes on the H200:
#     run(command="bash lab/device_megakernel.sh", timeout_s=500)
# Env: BENCH_ONLY (1: skip the tests),
#      FULL49 (1: also the 49-layer teacher-forced test at B = 1, the 32K-context test and the free-running figure;
#      NC_TEST_STEPS=256 for the issue's 256 steps, ~3 min more), BENCH_TORCH (1: torch too, its compiled step:
#      ~2 min of compiling; NORTHCODE_TORCH_COMPILE=0 for the eager one).
# Logs in $OUT/<phase>.log, figures in $OUT/report.jsonl (they come back as logs.tgz), the default's raw profiles
# as $OUT/profile-megakernel-b{1,8}-c8192.pt; a short table is printed last.
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
export PYTHONPATH=. NORTHCODE_HOME=/tmp/nch NC_REPORT="$OUT/report.jsonl" NORTHCODE_REQUIRE_GPU=1
export NC_TEST_STEPS=${NC_TEST_STEPS:-16} NC_TINY_STEPS=${NC_TINY_STEPS:-32} PYTHONUNBUFFERED=1
source lab/device_phase.sh
BUILD='
from concurrent.futures import ThreadPoolExecutor
from northcode.bench.decode_check import preset_config
from northcode.megakernel.kernel import build_library
with ThreadPoolExecutor(2) as pool:
    for path in pool.map(build_library, [preset_config("tiny"), preset_config("north-mini-code")]):
        print(path)
'
D=tests/gpu/test_megakernel_decode.py
T=tests/gpu/test_megakernel_tasks.py
phase build 60 python3 -c "$BUILD"
if [ "${BENCH_ONLY:-0}" != 1 ]; then  # BENCH_ONLY=1: build and time only (the tested kernel did not change)
phase tiny 100 python3 -m pytest -q -rf -k "not full5" $T tests/gpu/test_megakernel_kv_writes.py \
  tests/gpu/test_megakernel_sampling.py "$D::test_tiny_teacher_forced" "$D::test_free_running_greedy_agreement[tiny-4]"
# the engine on the kernel: MegakernelBackend's plumbing, pipelined launches, the Engine with backend=megakernel
phase engine 150 python3 -m pytest -q -rf tests/gpu/test_megakernel_backend.py tests/gpu/test_megakernel_backend_gpu.py \
  tests/gpu/test_engine_backend_choice_gpu.py
phase tasks5 60 python3 -m pytest -q -rf -k full5 $T
FULL_TESTS=("$D::test_full_shapes_shallow_teacher_forced")
[ "${FULL49:-0}" = 1 ] && FULL_TESTS+=("$D::test_full_teacher_forced[1]" "$D::test_full_32k_context" \
  "$D::test_free_running_greedy_agreement[north-mini-code-1]")
phase full ${FULL_LIMIT:-150} python3 -m pytest -q -rf "${FULL_TESTS[@]}"
fi
BACKENDS=megakernel
[ "${BENCH_TORCH:-0}" = 1 ] && BACKENDS="megakernel torch"
BENCH_LIMIT=150
[ "${BENCH_TORCH:-0}" = 1 ] && BENCH_LIMIT=330  # the torch step compiles batch 1 (~90 s cold) and 8 (~20 s)
phase bench $BENCH_LIMIT python3 -m northcode.bench.decode_bench --quick --profile --backends $BACKENDS \
  --out "$OUT/bench"
cp "$OUT/bench/decode_bench.json" "$OUT/decode_bench.json" 2>/dev/null
for b in 1 8; do  # the raw profiles come back (offline: python lab/profile_report.py FILE)
  cp "$OUT/bench/profile-megakernel-b$b-c8192.pt" "$OUT/" 2>/dev/null
  python3 lab/profile_report.py "$OUT/profile-megakernel-b$b-c8192.pt" --layer 25 > "$OUT/layer25-b$b.txt" 2>&1
done

echo "==== pytest ===="
grep -hE "^FAILED|^ERROR|passed|failed" "$OUT/tiny.log" "$OUT/engine.log" "$OUT/tasks5.log" "$OUT/full.log" | cut -c1-300 | tail -20
echo "==== teacher-forced (kernel / torch bf16 error against fp32 following the kernel's experts) ===="
python3 - "$OUT/report.jsonl" <<'PY'
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except OSError:
    rows = []
print(f"{'preset':<16}{'L':>3}{'B':>2}{'st':>4}{'relK':>8}{'relT':>8}{'ratio':>6}{'cosK':>9}{'cosT':>9}{'swK':>5}{'swT':>5}{'fail':>5}")
for r in rows:
    if r.get("test") == "teacher_forced":
        print(f"{r['preset']:<16}{r['layers'] or '':>3}{len(r['lengths']):>2}{r['steps']:>4}{r['kernel_rel_err_max']:8.4f}"
              f"{r['torch_rel_err_max']:8.4f}{r['rel_err_ratio_max']:6.2f}{r['kernel_min_cosine']:9.5f}{r['torch_min_cosine']:9.5f}"
              f"{r['kernel_expert_swaps']:5d}{r['torch_expert_swaps']:5d}{len(r['failures']):5d}")
        if r["failures"]:
            print("    first failure:", r["failures"][0][:150])
    elif r.get("test") == "free_running":
        print(f"free-running {r['preset']} lengths {r['lengths']}: agreeing steps {r['agreeing_steps']} of {r['steps']}")
PY
echo "==== bench decode --quick (8K) ===="
grep -E "profile |timeline " "$OUT/bench.log" | cut -c1-330
python3 - "$OUT/bench/decode_bench.json" <<'PY'
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except (OSError, ValueError) as err:
    sys.exit(f"no bench JSON: {err}")
print(f"read bandwidth {data['bandwidth']['read_tbps']:.2f} TB/s")
base = {r["batch"]: r["ms_per_step"] for r in data["results"] if r["backend"] == "megakernel"}
print(f"{'backend':<28}{'B':>3}{'ms/step':>9}{'tok/s':>8}{'GB':>7}{'SoL4.8':>8}{'SoLmeas':>8}{'vs megakernel':>14}")
for r in data["results"]:
    change = f"{100 * (r['ms_per_step'] / base[r['batch']] - 1):+.1f}%" if r["batch"] in base else "-"
    print(f"{r['backend']:<28}{r['batch']:>3}{r['ms_per_step']:9.3f}{r['tokens_per_s']:8.1f}{r['gb_per_step']:7.2f}"
          f"{100 * r['sol_datasheet']:7.1f}%{100 * r['sol_measured']:7.1f}%{change:>14}")
PY
echo "==== what gated layer 25 at B=1 (profile_report) ===="
sed -n '/gated/,$p' "$OUT/layer25-b1.txt" | cut -c1-150
echo "==== phases ===="
cat "$OUT/phases.txt"
# at most 8 files come back from $OUT: the logs travel as one archive
(cd "$OUT" && tar czf logs.tgz *.log *.txt report.jsonl 2>/dev/null && rm -f *.log report.jsonl layer25-b*.txt && rm -rf bench)
