#!/usr/bin/env bash
# The next megakernel device call, in one command of under 9 minutes on the lent H200:
#     run(command="bash tools/device_next_session.sh", timeout_s=570)
# Session 3 added five non-default variants (megakernel_variants.py; predictions in docs/performance.md):
# fused-tail, router-ticket, deep-loads, deep-moe and fast (all four). This call checks each for correctness
# on the tiny geometry (and fast on North Mini Code's shapes) and times each against the default in one run.
# Phases (each under its own time limit, sum 520 s; logs in $OUT/<phase>.log, figures in $OUT/report.jsonl):
#   build    both kernel builds (tiny; North Mini Code, shared by its 5-layer copy) in parallel; each build holds
#            the default kernel and the variant kernel
#   tiny     default kernel: per-task tests (with the variant kernel's own task forms), K/V writes, sampling,
#            free-running; tiny teacher-forced whole steps (B = 1, 2, 4, 8) for EVERY variant
#   tinyvar  the per-task tests again with NC_VARIANT=fast: every task form on the variant kernel, deep products on
#   tasks5   the per-task tests on North Mini Code's shapes (its first 5 layers, the full build), default flags
#   full     5-layer North Mini Code teacher-forced (B = 1, 8) for default and fast; the 49-layer model at B = 8 with fast
#   bench    northcode bench decode --quick --profile (B = 1 and 8 at 8K): default, tail-early and the four new
#            variants, then the torch baseline (last: a time-out loses only torch; the JSON is written per cell)
# Trimmed against session 2's script (those passed on the default kernel, whose code is unchanged): the per-layer
# diagnostic (decode_check), the 49-layer default tests (B = 2, 8, 32K context, free-running full), the backend
# plumbing test (TorchBackend is being changed by its owner); NC_TINY_STEPS 48 -> 32.
# The last lines printed are a short table: phase results, pytest failures, teacher-forced figures per variant,
# the bench table per variant with its change against the default, and the phase times.
set -u
OUT=${OUT:-/tmp/nc-out}
mkdir -p "$OUT"
export PYTHONPATH=. NORTHCODE_HOME=/tmp/nch NC_REPORT="$OUT/report.jsonl" NORTHCODE_REQUIRE_GPU=1
export NC_TEST_STEPS=16 NC_TINY_STEPS=32 PYTHONUNBUFFERED=1
NEW="fused-tail router-ticket deep-loads deep-moe fast"
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
T=tests/gpu/test_megakernel_tasks.py
phase build 55 python3 -c "$BUILD"
phase tiny 105 env NC_VARIANTS="default $NEW" python3 -m pytest -q -rf -k "not full5" $T \
  tests/gpu/test_megakernel_kv_writes.py tests/gpu/test_megakernel_sampling.py "$D::test_tiny_teacher_forced" \
  "$D::test_free_running_greedy_agreement[tiny-4]"
phase tinyvar 35 env NC_VARIANT=fast python3 -m pytest -q -rf -k "not full5" $T
phase tasks5 60 python3 -m pytest -q -rf -k full5 $T
phase full 115 env NC_VARIANTS="default fast" NC_VARIANT=fast python3 -m pytest -q -rf \
  "$D::test_full_shapes_shallow_teacher_forced" "$D::test_full_teacher_forced[8]"
phase bench 150 python3 -m northcode.bench.decode_bench --quick --profile \
  --variants megakernel/tail-early $(for v in $NEW; do printf 'megakernel/%s ' "$v"; done) --out "$OUT/bench"

echo "==== pytest failures ===="
grep -hE "^FAILED|^ERROR|passed|failed" "$OUT/tiny.log" "$OUT/tinyvar.log" "$OUT/tasks5.log" "$OUT/full.log" | tail -20
echo "==== teacher-forced figures (kernel and torch bf16 against fp32 following the kernel's experts) ===="
python3 - "$OUT/report.jsonl" <<'PY'
import json, sys
rows = []
for path in sys.argv[1:]:
    try:
        rows += [json.loads(line) for line in open(path)]
    except OSError:
        pass
print("relK/relT: logits' rel. error vs fp32 (kernel / torch bf16), worst row-step; ratio: worst kernel/torch; "
      "cos: worst cosine vs fp32; swK/swT: expert swaps vs fp32; rsd@L: worst residual ratio and its layer")
print(f"{'variant':<14}{'preset':<16}{'L':>3}{'B':>2}{'st':>4}{'relK':>8}{'relT':>8}{'ratio':>6}{'cosK':>9}"
      f"{'cosT':>9}{'swK':>5}{'swT':>5}{'rsd@L':>10}{'fail':>5}")
for r in rows:
    if r.get("test") == "teacher_forced":
        print(f"{r.get('variant', '?'):<14}{r['preset']:<16}{r['layers'] or '':>3}{len(r['lengths']):>2}{r['steps']:>4}"
              f"{r['kernel_rel_err_max']:8.4f}{r['torch_rel_err_max']:8.4f}{r['rel_err_ratio_max']:6.2f}"
              f"{r['kernel_min_cosine']:9.5f}{r['torch_min_cosine']:9.5f}{r['kernel_expert_swaps']:5d}"
              f"{r['torch_expert_swaps']:5d}{r.get('resid_ratio_max', 0):6.2f}@{str(r.get('resid_ratio_max_layer')):<3}"
              f"{len(r['failures']):5d}")
        if r["failures"]:
            print("    first failure:", r["failures"][0][:150])
    elif r.get("test") == "free_running":
        print(f"free-running {r['preset']} lengths {r['lengths']}: agreeing steps {r['agreeing_steps']} of {r['steps']}")
PY
echo "==== bench decode --quick (8K context) ===="
grep -E "profile " "$OUT/bench.log" | cut -c1-400
python3 - "$OUT/bench/decode_bench.json" <<'PY'
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except (OSError, ValueError) as err:
    sys.exit(f"no bench JSON: {err}")
print(f"read bandwidth {data['bandwidth']['read_tbps']:.2f} TB/s")
base = {r["batch"]: r["ms_per_step"] for r in data["results"] if r["backend"] == "megakernel"}
print(f"{'backend':<28}{'B':>3}{'ms/step':>9}{'tok/s':>8}{'GB':>7}{'SoL4.8':>8}{'SoLmeas':>8}{'vs default':>11}")
for r in data["results"]:
    change = f"{100 * (r['ms_per_step'] / base[r['batch']] - 1):+.1f}%" if r["batch"] in base else "-"
    print(f"{r['backend']:<28}{r['batch']:>3}{r['ms_per_step']:9.3f}{r['tokens_per_s']:8.1f}{r['gb_per_step']:7.2f}"
          f"{100 * r['sol_datasheet']:7.1f}%{100 * r['sol_measured']:7.1f}%{change:>11}")
PY
echo "==== phases ===="
cat "$OUT/phases.txt"
