#!/usr/bin/env bash
# Regenerate every benchmark: each scripts/bench_*.py writes docs/bench/NAME.csv and NAME.svg
# (the --csv/--svg convention, see scripts/benchlib.py); docs/bench/machine.txt records the machine.
#
#   scripts/bench_all.sh                 # all of them, default sizes (tens of minutes on 2 cores)
#   scripts/bench_all.sh loader sampler  # only these
#   QUICK=1 scripts/bench_all.sh         # small sizes, into /tmp/portable_loader_bench_quick: a check
#   OUT=dir scripts/bench_all.sh         # write the CSV, SVG and logs to dir instead of docs/bench
#
# Any new scripts/bench_NAME.py is picked up; extra arguments for one go in BENCH_ARGS_NAME.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ -n "${QUICK:-}" ]; then OUT=${OUT:-/tmp/portable_loader_bench_quick}; else OUT=${OUT:-docs/bench}; fi
mkdir -p "$OUT"
"$PY" -c 'import sys; sys.path.insert(0, "scripts"); import benchlib; print(benchlib.machine_report(), end="")' > "$OUT/machine.txt"
echo "date: $(date -u +%Y-%m-%dT%H:%MZ)" >> "$OUT/machine.txt"
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" >> "$OUT/machine.txt"

declare -A QUICK_ARGS=(
  [sampler]="--sizes 1000000 --grain-calls 20000 --batch 100000"
  [precache]="--rows 2000 --open-rows 100000 --skip-list"
  [loader]="--records 20000 --steps 200 --rounds 3"
  [torch]="--steps 10 --batch 16"
  [jax]="--steps 10 --batch 16"
  [describe]="--steps 400 --rounds 2"
  [remote]="--shards 8 --rows 40 --steps 100"
  [tokenized]="--rows 2000"
  [mix]="--steps 100 --rounds 3 --positions 100000"
  [cuda]="--steps 10 --batch 16 --reps 5 --peak-mib 64 --overlap-mib 16"
  [peers]="--records 20000 --rounds 1 --steps 200 --worker-steps 100 --resume-step 500"
  [grain]="--quick"
  [grain_shuffle]="--sizes 1000 100000 --count 300 --repeat 1"
  [pretrain]="--tokens 5000000 --rounds 1 --steps 200 --scale-tokens 1e9 --index-tokens 1e8"
  [workers]="--workers 0 1 --rounds 1 --steps 10 --tokens 3000000 --kinds concat packed map torch"
  [gpu_train]="--steps 5 --rounds 1 --sizes small"
)
if [ $# -gt 0 ]; then names=("$@"); else
  names=(); for f in scripts/bench_*.py; do n=${f#scripts/bench_}; names+=("${n%.py}"); done
fi
for name in "${names[@]}"; do
  var="BENCH_ARGS_${name}"
  extra=${!var:-}
  [ -n "${QUICK:-}" ] && extra="${QUICK_ARGS[$name]:-} $extra"
  echo "== bench_${name}.py ${extra}"
  # shellcheck disable=SC2086
  "$PY" "scripts/bench_${name}.py" --csv "$OUT/${name}.csv" --svg "$OUT/${name}.svg" $extra \
    2>&1 | tee "$OUT/${name}.log"
done
