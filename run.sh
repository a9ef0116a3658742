#!/usr/bin/env bash
# mini_dist's one entry point. On a fresh machine it creates .venv and installs requirements.txt
# (again only when that file changes); with MINI_DIST_PYTHON=python3 it uses that interpreter and the torch
# it already has instead (a GPU node's own torch, no registry needed). Then:
#   ./run.sh                            the tour: every demo under torchrun, then a summary table
#   ./run.sh test [--gpu] [ARGS]        the pytest suite (--gpu: NCCL ranks, one GPU each; ARGS go to pytest)
#   ./run.sh demo MODULE [NPROC] [ARGS] one demo on NPROC ranks (default 4; ARGS go to the demo, try --help)
#   ./run.sh bench [NPROC] [NAMES]      benchmarks against PyTorch's own implementations (default: all)
#   ./run.sh ask [N ...] [--markdown]   the questions learners ask, each answered by a figure measured now
#   ./run.sh exercise MODULE [--force]  write exercises/MODULE.py: the concept with its textbook code blanked
#   ./run.sh check MODULE [--every]     grade exercises/MODULE.py with the properties that prove mini_dist
#   ./run.sh hint MODULE                the next hint for the function of exercises/MODULE.py you are on
#   ./run.sh demos [N]                  every demo of the tour on at most N ranks (default 2), several at once
#   ./run.sh gpu                        the GPU check (one GPU): the suite on NCCL, every demo on 1 rank, a summary
set -euo pipefail
cd "$(dirname "$0")"

# The tour: module, ranks, arguments.
TOUR=(
  "kit/launch 4"
  "ring_allreduce 4"
  "ring_pipelined 4"
  "nccl_rule 1"
  "nccl_order 2"
  "alpha_beta 4 --ranks-per-node 2"
  "topology 4 --ranks-per-node 2"
  "collectives 4"
  "all_to_all 4"
  "comm 4"
  "kit/debug 2"
  "ddp 4"
  "buckets 2"
  "reducer 2"
  "compression 4"
  "zero 4"
  "zero_optimizer 4"
  "zero_ledger 4"
  "sharded_state 4"
  "flat_param 4"
  "fsdp_state 4"
  "fsdp 4"
  "fsdp_ledger 4"
  "checkpoint_plan 3"
  "checkpoint 4"
  "manifest 1"
  "reshard 4"
  "reshard_zero 4"
  "recovery 4"
  "mixed_precision 1"
  "loss_scaling 1"
  "sharded_loss_scaling 4"
  "kit/measure 1"
  "activation_checkpoint 1"
  "selective_checkpoint 1"
  "tensor_parallel 4"
  "tp_layout 4"
  "parallel_transformer 4"
  "vocab_parallel 4"
  "sequence_layout 4"
  "context_parallel 4"
  "ulysses 4"
  "moe 1"
  "expert_parallel 4"
  "pipeline_stages 4"
  "pipeline 4"
  "pipeline_actions 4"
  "pipeline_schedules 4"
  "pipeline_agreement 4"
  "pipeline_messages 4"
  "pipeline_executor 4"
  "pipeline_bubble 4"
  "mesh 4 --dp 2 --tp 2"
  "tiny_gpt 4 --cp 2 --tp 2 --moe 4 --ep 2"
  "parallel_gpt 4 --cp 2 --tp 2 --moe 4 --ep 2"
  "train_5d 8 --dp 2 --pp 2 --tp 2"
  "measure_5d 8 --dp 2 --pp 2 --cp 2 --moe 4 --ep 2"
  "cost_model 1"
  "gpt_ledger 1"
  "rank_ledger 1"
  "step_time 1"
  "planner 1"
)

setup() {
  if [ -n "${MINI_DIST_PYTHON:-}" ]; then  # the active environment, as it is: nothing is installed
    PY=$MINI_DIST_PYTHON
    "$PY" -c 'import torch, numpy, pytest, hypothesis' 2>/dev/null || {
      echo "./run.sh: MINI_DIST_PYTHON=$PY lacks torch, numpy, pytest or hypothesis: install them there," \
           "or unset MINI_DIST_PYTHON to use .venv" >&2; exit 2; }
    return
  fi
  PY=.venv/bin/python
  local python=${PYTHON:-python3}
  [ -x .venv/bin/python ] || "$python" -m venv .venv
  local want have
  want=$(cksum < requirements.txt)
  have=$(cat .venv/.requirements.cksum 2>/dev/null || true)
  if [ "$want" != "$have" ]; then
    echo "installing requirements into .venv ..." >&2
    .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
    echo "$want" > .venv/.requirements.cksum
  fi
}

# torchrun with its own report kept out of the way of a usage error: every rank of a demo that cannot
# run its configuration exits with status 2 after rank 0 printed one "error:" line; torchrun would then
# add a 40-line report about the exit codes, which says nothing more. Other failures keep everything.
# (The ranks' stderr is shown when the run ends; their stdout as it comes.)
launch() {
  local ranks=$1 cpus err status=0
  shift
  [ "$ranks" -ge 1 ] || { echo "./run.sh: the rank count must be at least 1, got $ranks" >&2; return 2; }
  # torchrun warns (once per run) and sets 1 thread per rank when OMP_NUM_THREADS is unset: share the
  # cores among the ranks ourselves
  cpus=$(cores)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cpus / ranks > 1 ? cpus / ranks : 1 ))}
  # a rank killed by a signal (SIGSEGV, or SIGABRT from C++ inside torch) prints every thread's Python stack
  export PYTHONFAULTHANDLER=${PYTHONFAULTHANDLER:-1}
  err=$(mktemp)
  trap 'cat "$err" >&2; rm -f "$err"' INT TERM
  # MINI_DIST_DEMO_TIMEOUT (the tour's default: 600 s) stops a demo that hangs, so a loop over demos goes on
  local bound=() limit=${MINI_DIST_DEMO_TIMEOUT:-}
  if [ -n "$limit" ] && command -v timeout > /dev/null; then bound=(timeout --kill-after=30 "$limit"); fi
  ${bound[@]+"${bound[@]}"} "$PY" -m torch.distributed.run --standalone --nproc_per_node="$ranks" "$@" 2>"$err" \
    || status=$?
  trap - INT TERM
  if [ ${#bound[@]} -gt 0 ] && { [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; }; then
    tail -n 20 "$err" >&2; rm -f "$err"
    echo "./run.sh: $1 on $ranks rank(s) did not finish within MINI_DIST_DEMO_TIMEOUT=$limit s: stopped" >&2
    return 1
  fi
  # torchrun itself exits 1 whatever its ranks' codes were; its report names the first code seen
  if [ "$status" -ne 0 ] && grep -q 'exitcode *: 2 ' "$err" && grep -q '^[a-z_0-9.]*: error: ' "$err"; then
    grep '^[a-z_0-9.]*: error: ' "$err" | sort -u >&2
    status=2
  elif [ "$status" -ne 0 ] && grep -q 'exitcode *: 1 ' "$err" && ! grep -q '^\[rank[0-9]*\]: Traceback' "$err"; then
    # the ranks ran to the end and said FAIL or MISS: keep their words, not torchrun's traceback of itself
    sed '/^E[0-9]\{4\} .*failed (exitcode: 1)/,$d' "$err" >&2
    echo "./run.sh: exit 1: a check or a target above was missed (FAIL / MISS)" >&2
  else
    cat "$err" >&2
    # the rank that failed first: the one the survivors name (mini_dist/kit/fates.py: "lost rank 2 (it ..."),
    # else torchrun's root cause (a rank that ended before any survivor could speak)
    local first=""
    if [ "$status" -ne 0 ]; then
      first=$(grep -o 'lost rank [0-9]* (it ' "$err" | sort | uniq -c | sort -rn | head -n 1 | grep -o 'rank [0-9]*' \
              || true)
      [ -n "$first" ] || first=$(sed -n '/Root Cause/,$p' "$err" | grep -o '^ *rank *: [0-9]*' | head -n 1 \
                                 | tr -s ' :' ' ' | sed 's/^ //' || true)
    fi
    [ -z "$first" ] || echo "./run.sh: $first failed first: its own lines ([${first/ /}]: ...) say why" >&2
  fi
  rm -f "$err"
  return "$status"
}

modules() { ls mini_dist/*.py mini_dist/kit/{launch,debug,measure}.py | sed 's|mini_dist/||; s|\.py$||' | grep -v '^_' | tr '\n' ' '; }

demo() {
  local module=${1:-} nproc=4
  [ -n "$module" ] && [ -f "mini_dist/$module.py" ] && [ "${module#_}" = "$module" ] || {
    echo "./run.sh demo: no module '${module}'; choose one of: $(modules)" >&2; return 2; }
  shift
  if [[ "${1:-}" =~ ^[0-9]+$ ]]; then nproc=$1; shift; fi  # a number is the rank count, anything else a flag
  if [ "$module" = planner ]; then
    "$PY" -m mini_dist.planner "$@"
  elif [[ " $* " =~ \ (-h|--help)\  ]]; then  # help needs no ranks
    "$PY" "mini_dist/$module.py" "$@"
  else
    launch "$nproc" "mini_dist/$module.py" "$@"
  fi
}

tour() {
  local log status=0 failed=() entry n=0
  export MINI_DIST_DEMO_TIMEOUT=${MINI_DIST_DEMO_TIMEOUT:-600}
  log=$(mktemp)
  for entry in "${TOUR[@]}"; do
    set -- $entry
    n=$((n + 1))
    [ -f "mini_dist/$1.py" ] || continue
    echo; echo "=== $n of ${#TOUR[@]}: $entry ==="
    if ! demo "$@" 2>&1 | tee -a "$log"; then failed+=("$1"); status=1; fi
  done
  echo; echo "=== summary ==="
  printf '%-16s | %-40s | %s\n' module "check vs PyTorch" "measured figure vs formula"
  grep '^SUMMARY|' "$log" | while IFS='|' read -r _ module check figure; do
    printf '%-16s | %-40s | %s\n' "$module" "$check" "$figure"
  done
  rm -f "$log"
  [ ${#failed[@]} -eq 0 ] || echo "demos that exited non-zero: ${failed[*]}"
  return $status
}

torch_version() { "$PY" -c 'import torch; print(torch.__version__)'; }

# The cores this process may use: nproc, or fewer when a container's CPU quota says so (a container may see
# every core of its host and get a quota of two).
cores() {
  local n quota period
  n=$(nproc)
  if read -r quota period 2>/dev/null < /sys/fs/cgroup/cpu.max && [ "$quota" != max ]; then
    n=$(( (quota + period - 1) / period < n ? (quota + period - 1) / period : n ))
  fi
  echo $(( n >= 1 ? n : 1 ))
}

# One demo of every_demo in the background: its output to AT.out, then its exit status to AT.code (written last:
# its presence says the demo is done). A rank killed by a signal is a crash inside torch's C++, not a check that
# failed: that output is kept as AT.crash, the signal in AT.signal, and the demo runs once more.
demo_job() {
  local at=$1 code signal
  shift
  demo "$@" > "$at.out" 2>&1 && code=0 || code=$?
  if [ "$code" -ne 0 ] && signal=$(grep -o -m1 'Signal [0-9]* (SIG[A-Z]*)' "$at.out"); then
    mv "$at.out" "$at.crash"
    echo "$signal" > "$at.signal"
    demo "$@" > "$at.out" 2>&1 && code=0 || code=$?
  fi
  echo "$code" > "$at.tmp"
  mv "$at.tmp" "$at.code"
}

# What demo_job AT left, shown as it happens in the tour's order: a pass and a refusal its last lines, a failure
# enough to see which rank died and how. Counts into every_demo's passed / refused / failed / crashed (bash
# functions see their caller's locals).
demo_report() {
  local at=$1 module=$2 ranks=$3 code signal
  code=$(cat "$at.code")
  echo "=== $module on $ranks rank(s) ==="
  if [ -f "$at.crash" ]; then
    signal=$(cat "$at.signal")
    tail -n 60 "$at.crash"
    echo "=== $module: a rank was killed by $signal: once more ==="
    crashed+=("$module ($signal, then exit $code)")
  fi
  case $code in
    0) tail -n 4 "$at.out"; passed+=("$module") ;;
    2) tail -n 4 "$at.out"; echo "(needs more ranks: not a failure)"; refused+=("$module") ;;
    *) tail -n 60 "$at.out"; failed+=("$module") ;;
  esac
}

# Every demo of the tour on at most N ranks: where the tour gives a demo more ranks, it runs on N without its
# grid flags; a demo that cannot run on so few says so and exits 2, which is not a failure. The GPU check runs
# it on one rank; CI on one rank, and on two under the oldest torch mini_dist supports. Demos are independent
# processes (each torchrun finds a free port), so MINI_DIST_PARALLEL of them run at once: by default one per
# two cores per rank (one computes, one keeps its Python and communication threads going), at most 8, each
# rank's share of OMP threads cut to match. Their output is shown in the tour's order as each is done; the
# last line counts them (DEMO_SUMMARY keeps it for the GPU check).
every_demo() {
  local most=${1:-2} start=$SECONDS entry runs=() passed=() refused=() failed=() crashed=() dir i=0 shown=0
  local cpus width
  cpus=$(cores)
  width=${MINI_DIST_PARALLEL:-$(( cpus / (2 * most) > 8 ? 8 : cpus / (2 * most) ))}
  [[ "$width" =~ ^[0-9]+$ ]] || { echo "./run.sh: MINI_DIST_PARALLEL is how many demos run at once: a number," \
                                       "got '$width'" >&2; return 2; }
  width=$(( width < 1 ? 1 : width ))
  export MINI_DIST_DEMO_TIMEOUT=${MINI_DIST_DEMO_TIMEOUT:-600}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cpus / (most * width) > 1 ? cpus / (most * width) : 1 ))}
  for entry in "${TOUR[@]}"; do
    set -- $entry
    [ -f "mini_dist/$1.py" ] || continue
    local module=$1 ranks=$(( $2 < most ? $2 : most ))
    shift 2
    [ "$ranks" -lt "$most" ] || [[ ! " $* " =~ \ --(ranks-per-node|dp|pp|cp|tp|ep)\  ]] || set --
    runs+=("$module $ranks $*")
  done
  dir=$(mktemp -d)
  # Ctrl-C or a TERM stops every demo running: the demos ignore Ctrl-C (a shell without job control starts them
  # so) and run under `timeout`, in process groups of their own; a TERM to each `timeout` stops its torchrun
  trap 'trap - INT TERM; for job in $(jobs -p); do pkill -TERM -P "$job"; done; wait; rm -rf "$dir"; exit 130' INT TERM
  while [ "$shown" -lt ${#runs[@]} ]; do
    if [ "$i" -lt ${#runs[@]} ] && [ $(( i - $(ls "$dir" | grep -c '\.code$' || true) )) -lt "$width" ]; then
      demo_job "$dir/$i" ${runs[$i]} &
      i=$((i + 1))
    elif [ -f "$dir/$shown.code" ]; then
      demo_report "$dir/$shown" ${runs[$shown]}
      shown=$((shown + 1))
    else
      sleep 0.5
    fi
  done
  wait
  trap - INT TERM
  rm -rf "$dir"
  DEMO_SUMMARY="${#passed[@]} passed, ${#refused[@]} refused${refused[*]:+ (need more ranks: ${refused[*]})}, "
  DEMO_SUMMARY+="${#failed[@]} failed${failed[*]:+: ${failed[*]}}"
  echo "torch $(torch_version), every demo on at most $most rank(s), $width at" \
       "once: $DEMO_SUMMARY; $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
  [ ${#crashed[@]} -eq 0 ] || echo "a rank was killed by a signal, output above, in: ${crashed[*]}"
  [ ${#failed[@]} -eq 0 ]
}

# The GPU check, for one GPU: the suite on NCCL (tests that need more GPUs than there are skip, saying how
# many), then every demo of the tour on one rank, several at once (every_demo), then one summary. NCCL refuses
# two ranks on one GPU, so world size 1 is all one GPU can show; the ordering NCCL imposes on many GPUs is
# proven on the CPU (tests/test_nccl_order.py). MINI_DIST_BACKEND=gloo runs the same check on the CPU, to try
# the check itself where no GPU is.
gpu_check() {
  local status=0 start=$SECONDS backend=${MINI_DIST_BACKEND:-nccl} machine log counts what tests=""
  if [ "$backend" = nccl ]; then
    machine=$("$PY" - 2>/dev/null <<'EOF'
import torch
print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| NCCL",
      ".".join(map(str, torch.cuda.nccl.version())))
EOF
    ) || {
      echo "./run.sh gpu: torch $(torch_version) sees no CUDA GPU here; run it on a GPU node" \
           "(MINI_DIST_PYTHON=python3 ./run.sh gpu uses that node's own torch)" >&2; return 2; }
  else
    machine="GPU: none (MINI_DIST_BACKEND=$backend: this check on the CPU) | torch $(torch_version)"
  fi
  echo "$machine"
  log=$(mktemp)
  MINI_DIST_BACKEND=$backend "$PY" -m pytest -q -rs -p no:cacheprovider tests --deselect tests/test_cli.py \
    --deselect tests/test_questions.py 2>&1 | tee "$log" || status=1
  counts=$(grep -E '^=* ?[0-9]+ (passed|failed|skipped|errors?|deselected)' "$log" | tail -n 1)
  MINI_DIST_BACKEND=$backend every_demo 1 || status=1
  echo; echo "=== ./run.sh gpu: summary ==="
  echo "$machine"
  for what in passed skipped failed; do
    tests+="$(grep -o "[0-9]* $what" <<< "$counts" || echo "0 $what"), "
  done
  echo "tests: ${tests%, }$(grep -o ', [0-9]* errors\?' <<< "$counts" || true)"
  # the skips by reason (pytest -rs: "SKIPPED [count] file:line: reason"), most first
  awk '/^SKIPPED \[[0-9]+\] / { n = substr($2, 2, length($2) - 2); sub(/^SKIPPED \[[0-9]+\] [^ ]* /, "")
                               count[$0] += n }
       END { for (why in count) printf "  %d skipped: %s\n", count[why], why }' "$log" | sort -t' ' -k3,3nr
  rm -f "$log"
  echo "demos on 1 rank: $DEMO_SUMMARY"
  echo "took $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
  return $status
}

setup
case "${1:-tour}" in
  tour) tour ;;
  test)
    shift
    if [ "${1:-}" = "--gpu" ]; then shift; export MINI_DIST_BACKEND=nccl; fi
    "$PY" -m pytest -q tests "$@" ;;
  demo) shift; demo "$@" ;;
  bench)
    shift
    nproc=4
    if [[ "${1:-}" =~ ^[0-9]+$ ]]; then nproc=$1; shift; fi
    launch "$nproc" -m mini_dist.bench "$@" ;;
  ask) shift; "$PY" -m mini_dist.questions "$@" ;;  # it starts its own ranks
  gpu) gpu_check ;;
  demos) shift; every_demo "${1:-2}" ;;
  exercise|check|hint) "$PY" mini_dist/kit/exercise.py "$@" ;;  # a script: the grader starts torch, not this
  -h|--help|help) sed -n '2,14p' "$0" ;;
  *) echo "./run.sh: unknown command '$1'" >&2; sed -n '2,14p' "$0" >&2; exit 2 ;;
esac
