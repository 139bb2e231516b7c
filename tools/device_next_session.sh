#!/usr/bin/env bash
# The next megakernel device call, in one command of under 9 minutes on the lent H200:
#     run(command="bash tools/device_next_session.sh", timeout_s=570)
# Phases (each under its own time limit, logs in $OUT/<phase>.log, figures in $OUT/report.jsonl):
#   build   both kernel builds (tiny; North Mini Code, shared by its 5-layer copy) in parallel
#   tiny    per-task tests, K/V writes, sampling, tiny whole steps (teacher-forced, free-running)
#   tasks5  the per-task tests on North Mini Code's shapes (its first 5 layers, the full build)
#   diag    the per-layer diagnostic: full model, batch 1, context 4090, 16 steps (= test_full_teacher_forced[1])
#   full    North Mini Code's shapes over 5 layers (batch 1, 8), full model batch 8, 32K, free-running, the
#           backend's plumbing, full model batch 2 (batch 4 is left out for time)
#   bench   northcode bench decode --quick --profile (B = 1 and 8 at 8K, megakernel and torch), with the
#           tail-early wave order and prefetch off timed beside the default (docs/performance.md predicts both)
# The last lines printed are a short table: phase results, the teacher-forced figures, the bench table.
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
export PYTHONPATH=. NORTHCODE_HOME=/tmp/nch NC_REPORT="$OUT/report.jsonl" NORTHCODE_REQUIRE_GPU=1
export NC_TEST_STEPS=16 NC_TINY_STEPS=48 PYTHONUNBUFFERED=1
: > "$OUT/phases.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1

phase() {  # phase NAME LIMIT_S COMMAND...: run with a time limit, record rc and seconds
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  [ $rc -eq 124 ] && rc="124(timeout ${limit}s)"
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/phases.txt"
}

BUILD='
from concurrent.futures import ThreadPoolExecutor
from northcode.bench.decode_check import preset_config
from northcode.engine.megakernel import build_library
with ThreadPoolExecutor(2) as pool:  # nvcc runs as two processes; builds lock per geometry
    for path in pool.map(build_library, [preset_config("tiny"), preset_config("north-mini-code")]):
        print(path)
'

D=tests/gpu/test_megakernel_decode.py
phase build 50 python3 -c "$BUILD"
phase tiny 75 python3 -m pytest -q -rf -k "not full5" tests/gpu/test_megakernel_tasks.py \
  tests/gpu/test_megakernel_kv_writes.py tests/gpu/test_megakernel_sampling.py "$D::test_tiny_teacher_forced" \
  "$D::test_free_running_greedy_agreement[tiny-4]"
phase tasks5 45 python3 -m pytest -q -rf -k full5 tests/gpu/test_megakernel_tasks.py
phase diag 75 python3 -m northcode.bench.decode_check --preset north-mini-code --lengths 4090 --steps 16 \
  --json "$OUT/diag.jsonl"
phase full 135 python3 -m pytest -q -rf "$D::test_full_shapes_shallow_teacher_forced" "$D::test_full_teacher_forced[8]" \
  "$D::test_full_32k_context" "$D::test_free_running_greedy_agreement[north-mini-code-1]" \
  tests/gpu/test_megakernel_backend.py "$D::test_full_teacher_forced[2]"
phase bench 145 python3 -m northcode.bench.decode_bench --quick --profile \
  --variants megakernel/tail-early megakernel/no-prefetch --out "$OUT/bench"

echo "==== per-layer diagnostic (full model, B=1, 4090, first and last layers) ===="
grep -E "^ *(layer|[0-9]+) " "$OUT/diag.log" | sed -n '1,6p;45,51p'
grep -E "^first layer|^FAIL" "$OUT/diag.log" | head -4
echo "==== pytest failures ===="
grep -hE "^FAILED|^ERROR|passed|failed" "$OUT/tiny.log" "$OUT/tasks5.log" "$OUT/full.log" | tail -16
echo "==== teacher-forced figures (kernel and torch bf16 against fp32 following the kernel's experts) ===="
python3 - "$OUT/diag.jsonl" "$OUT/report.jsonl" <<'PY'
import json, sys
rows = []
for path in sys.argv[1:]:
    try:
        rows += [json.loads(line) for line in open(path)]
    except OSError:
        pass
print("relK/relT: logits' rel. error vs fp32 (kernel / torch bf16), worst row-step; ratio: worst kernel/torch; "
      "cos, abs: worst cosine and max |diff| vs fp32; swK/swT: layers where kernel's / torch's own experts differ "
      "from fp32's; gapK: largest fp32 gap at a kernel swap; rsd@L: worst mean residual error ratio and its layer")
print(f"{'preset':<16}{'L':>3}{'B':>2}{'st':>4}{'relK':>8}{'relT':>8}{'ratio':>6}{'cosK':>9}{'cosT':>9}"
      f"{'absK':>6}{'absT':>6}{'swK':>5}{'swT':>5}{'gapK':>6}{'rsd@L':>10}{'jump':>5}{'fail':>5}")
for r in rows:
    if r.get("test") == "teacher_forced":
        print(f"{r['preset']:<16}{r['layers'] or '':>3}{len(r['lengths']):>2}{r['steps']:>4}{r['kernel_rel_err_max']:8.4f}"
              f"{r['torch_rel_err_max']:8.4f}{r['rel_err_ratio_max']:6.2f}{r['kernel_min_cosine']:9.5f}"
              f"{r['torch_min_cosine']:9.5f}{r['kernel_max_abs']:6.2f}{r['torch_max_abs']:6.2f}"
              f"{r['kernel_expert_swaps']:5d}{r['torch_expert_swaps']:5d}{r['kernel_swap_gap_max']:6.3f}"
              f"{r.get('resid_ratio_max', 0):6.2f}@{str(r.get('resid_ratio_max_layer')):<3}"
              f"{str(r['first_jump_layer']):>5}{len(r['failures']):5d}")
        if r["failures"]:
            print("    first failure:", r["failures"][0][:150])
    elif r.get("test") == "free_running":
        print(f"free-running {r['preset']} lengths {r['lengths']}: agreeing steps {r['agreeing_steps']} of {r['steps']}")
PY
echo "==== bench decode --quick ===="
grep -E "profile:" "$OUT/bench.log" | head -6
tail -9 "$OUT/bench.log"
echo "==== phases ===="
cat "$OUT/phases.txt"
