#!/usr/bin/env bash
# The remat commands on CUDA, with GPU correctness first: run from the repo root on the device machine;
# writes $OUT/gpu_correctness.json, $OUT/gpu_correctness.log and $OUT/cli_cuda_h200.txt.
export PYTHONPATH=src
remat() { python -c "import sys; from remat.cli import main; sys.exit(main(sys.argv[1:]))" "$@"; }
python benchmarks/gpu_correctness.py > $OUT/gpu_correctness.log 2>&1; echo "gpu_correctness rc=$?"
S8='-mr llama3_8b --num_layers 2 -sl 4096 -mb 1 --compile --no_progress'
{
echo "# remat CLI on one H200 ($(python -c 'import torch;print(torch.__version__)')), $(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null || echo ea65d92)"
for cmd in \
 "verify -mr llama3_tiny --device cuda --recompute_modules core_attn,layernorm,mlp --attention_dropout 0.1 --hidden_dropout 0.1" \
 "verify -mr llama3_tiny --device cuda -ol 2 --min_offloaded_tensor_size 64" \
 "verify -mr llama3_tiny --device cuda --tolerance -1 -mb 0" \
 "bench $S8 -g h200 -ms 6 --warmup_steps 2 --recompute_modules mlp --no_history" \
 "bench $S8 -ms 4 --warmup_steps 0 --no_history" \
 "doctor -mr llama3_tiny --device cuda -ms 4 --no_progress" \
 "plan $S8 --memory-budget 8GiB -ms 5 --no_history" \
 "plan $S8 --memory-budget 8GiB --verify -ms 5 --warmup_steps 2 --no_history -o /tmp/p.yaml"; do
  echo; echo "\$ remat $cmd"; remat $cmd 2>&1 | grep -v "^W1\|UserWarning\|warnings.warn"; echo "exit ${PIPESTATUS[0]}"
done
} > $OUT/cli_cuda_h200.txt 2>&1
tail -5 $OUT/gpu_correctness.log
