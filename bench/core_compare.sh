#!/usr/bin/env bash
# Same runs on an older core and on this checkout, side by side (a core refactor must not change training).
#   bash bench/core_compare.sh OLD_REV [name]...
# For each configuration, runs `verl run` with the old core (OLD_REV's verl_core and verl_cli first on
# PYTHONPATH, the installed plugins otherwise) and with this checkout, and prints the validation reward
# (val/reward_mean, greedy) at each validation step. Seeded configurations must print identical figures;
# SGLang does not seed its sampling (compare several runs). With "overhead" among the names it also runs
# bench/controller_overhead.py alternately on both, 2 rounds, and prints the step-time table of each.
set -uo pipefail
cd "$(dirname "$0")/.."
old_rev=$1; shift
names=${*:-default ppo vllm megatron async ray tools vision sglang}
old=$(mktemp -d)/old
git worktree add -q "$old" "$old_rev" || exit 1
trap 'git worktree remove --force "$old"; git worktree prune' EXIT
out=$(mktemp -d)
declare -A ARGS=(
  [default]="" [ppo]="--algo ppo --max-steps 20" [vllm]="--rollout vllm --max-steps 20"
  [megatron]="--backend megatron --max-steps 20" [async]="--max-steps 20 trainer.mode=\"colocate_async\""
  [ray]="--max-steps 20 executor.name=\"ray\"" [tools]="--env tools --max-steps 10"
  [vision]="--env vision --max-steps 10" [sglang]="--rollout sglang --max-steps 10")
for name in $names; do
  if [ "$name" = overhead ]; then
    for round in 1 2; do
      (cd "$old" && PYTHONPATH="$old/verl_core/src:$old/verl_cli/src" python bench/controller_overhead.py --steps 8 \
        --warmup 2 >/dev/null 2>&1 && echo "overhead old round $round" && sed -n 9,11p bench/results/controller_overhead.md)
      python bench/controller_overhead.py --steps 8 --warmup 2 >/dev/null 2>&1 && echo "overhead new round $round" \
        && sed -n 9,11p bench/results/controller_overhead.md
      git checkout -q bench/results/controller_overhead.md  # the committed report stays
    done
    continue
  fi
  for side in old new; do
    run=$out/$name-$side
    pp=""; [ $side = old ] && pp="$old/verl_core/src:$old/verl_cli/src"
    start=$(date +%s)
    eval PYTHONPATH="$pp" OMP_NUM_THREADS=1 timeout 900 python -m verl_cli run ${ARGS[$name]} \
      run.output_dir="$run" "run.loggers='[\"jsonl\"]'" >"$run.log" 2>&1
    echo "$name $side rc=$? $(( $(date +%s) - start ))s $(python -c '
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
print(" ".join("%d:%.3f" % (r["step"], r["val/reward_mean"]) for r in rows if "val/reward_mean" in r))' "$run" 2>&1)"
  done
done
