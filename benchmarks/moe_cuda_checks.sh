#!/usr/bin/env bash
# remat's commands on an MoE model on CUDA (issue 26): bench with no recompute and with the experts'
# inputs offloaded (Megatron's expert_fc1 and moe_act offload modules), the planner with offload
# against its measured peak, and doctor on a micro-batch that does not fit. From the repo root on
# the device machine; writes $OUT/moe_cuda_checks.txt. Each command has a time limit (seconds) as
# its first word.
export PYTHONPATH=src
remat() { python -c "import sys; from remat.cli import main; sys.exit(main(sys.argv[1:]))" "$@"; }
QWEN="-mr qwen3_30b_a3b --num_layers 4 -sl 4096"
RUN="-ms 5 --warmup_steps 2 --no_history --no_progress"
printf 'fine_grained_activation_offloading: true\noffload_modules: [expert_fc1, moe_act]\n' > /tmp/moe_offload.yaml
{
echo "# remat CLI on an MoE model, $(python -c 'import torch;print(torch.cuda.get_device_name(), "torch", torch.__version__)'), $(date -u +%F)"
for cmd in \
 "60 bench $QWEN -mb 4 $RUN" \
 "60 bench $QWEN -mb 4 --config /tmp/moe_offload.yaml $RUN" \
 "120 plan $QWEN -mb 4 --memory-budget 25.5GiB --offload --verify $RUN" \
 "90 doctor $QWEN -mb 64 $RUN"; do
  limit=${cmd%% *}; args=${cmd#* }
  echo; echo "\$ remat $args"; timeout $limit bash -c "$(declare -f remat); remat $args" 2>&1 | grep -v "UserWarning\|warnings.warn"
  echo "exit ${PIPESTATUS[0]}"
done
} > $OUT/moe_cuda_checks.txt
