#!/usr/bin/env bash
# mini_dist's one entry point. On a fresh machine it creates .venv and installs requirements.txt
# (again only when that file changes), then:
#   ./run.sh                       the tour: every demo under torchrun, then a summary table
#   ./run.sh test [--gpu] [args]   the pytest suite (--gpu: NCCL ranks, one GPU each; args go to pytest)
#   ./run.sh demo MODULE [NPROC]   one demo (NPROC defaults to 4; extra args go to the module)
#   ./run.sh bench [NPROC]         every module's benchmark against its PyTorch reference
set -euo pipefail
cd "$(dirname "$0")"

MODULES=(launch ring_allreduce ddp zero fsdp tensor_parallel vocab_parallel pipeline mixed_precision mesh train_3d planner)

setup() {
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

demo() {
  local module=$1 nproc=${2:-4}
  shift $(( $# < 2 ? $# : 2 ))
  [ -f "mini_dist/$module.py" ] || { echo "no such module: mini_dist/$module.py" >&2; return 2; }
  if [ "$module" = planner ]; then
    .venv/bin/python -m mini_dist.planner "$@"
  else
    .venv/bin/torchrun --standalone --nproc_per_node="$nproc" "mini_dist/$module.py" "$@"
  fi
}

tour() {
  local log status=0 failed=()
  log=$(mktemp)
  for module in "${MODULES[@]}"; do
    [ -f "mini_dist/$module.py" ] || continue
    echo; echo "=== $module ==="
    if ! demo "$module" 4 2>&1 | tee -a "$log"; then failed+=("$module"); status=1; fi
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

setup
case "${1:-tour}" in
  tour) tour ;;
  test)
    shift
    if [ "${1:-}" = "--gpu" ]; then shift; export MINI_DIST_BACKEND=nccl; fi
    .venv/bin/python -m pytest -q tests "$@" ;;
  demo) shift; demo "$@" ;;
  bench)
    nproc=${2:-4} status=0
    for module in "${MODULES[@]}"; do
      [ -f "mini_dist/$module.py" ] && grep -q -- '--bench' "mini_dist/$module.py" || continue
      echo; echo "=== bench $module ==="
      demo "$module" "$nproc" --bench || { echo "bench $module missed its target"; status=1; }
    done
    exit $status ;;
  *) sed -n '2,8p' "$0"; exit 2 ;;
esac
