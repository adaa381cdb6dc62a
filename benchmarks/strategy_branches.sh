#!/bin/bash
# Count the places the package's code branches on a training strategy or rollout name (issue 20's figure):
# comparisons of a strategy / kind / rollout.name against "ddp", "fsdp", "megatron", "hf" or "vllm", attribute
# probes of a rollout, and the megatron flags the worker used to carry. Tests are not counted.
#   bash benchmarks/strategy_branches.sh [REPO]   (default: this checkout; works on checkouts of every layout)
cd "${1:-$(dirname "$0")/..}" || exit 1
dirs=$(ls -d hybridflow cli engine flows mapping slurm tasks core algorithms backends rollout reward runtime orchestration store \
  placement 2>/dev/null)
hits=$(grep -rnE '(strategy|\.kind|rollout\.name|\bname) *(==|!=|not in|in) *\(?"(ddp|fsdp|megatron|hf|vllm)"|hasattr\((self\.)?rollout|getattr\((self\.)?rollout|_megatron\b|megatron_critic\b|megatron_tp\b' \
  --include=*.py $dirs | grep -v 'import ' | grep -v '^[^:]*:[0-9]*: *#')
echo "strategy/rollout branches: $(printf '%s\n' "$hits" | grep -c .)"
printf '%s\n' "$hits" | cut -d: -f1 | sort | uniq -c | sort -rn
