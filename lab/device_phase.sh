# Sourced by the one-call device scripts (lab/device_*.sh): `phase NAME LIMIT_S COMMAND...` runs COMMAND with a
# time limit, logs it to $OUT/NAME.log and records "NAME rc=RC SECONDSs" in $OUT/phases.txt (and on stdout).
: > "$OUT/phases.txt"
phase() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  [ $rc -eq 124 ] && rc="124(timeout ${limit}s)"
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/phases.txt"
}
