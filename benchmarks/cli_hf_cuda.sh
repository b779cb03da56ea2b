#!/usr/bin/env bash
# remat's commands on transformers models on CUDA (the default fast path: chunked loss head and
# compiled Sites): run from the repo root on the device machine; writes $OUT/cli_hf_cuda.txt.
export PYTHONPATH=src
remat() { python -c "import sys; from remat.cli import main; sys.exit(main(sys.argv[1:]))" "$@"; }
{
echo "# remat CLI on HF models, $(python -c 'import torch,transformers;print(torch.cuda.get_device_name(), "torch", torch.__version__, "transformers", transformers.__version__)'), $(date -u +%F)"
for cmd in \
 "verify -m hf --hf_config mixtral --device cuda --num_layers 2 -sl 64 -rl 1 --recompute_method uniform" \
 "bench -m hf --hf_config llama --num_layers 4 -sl 4096 -mb 4 -ms 6 --warmup_steps 2 --no_history --no_progress" \
 "bench -m hf --hf_config llama --num_layers 4 -sl 4096 -mb 4 -ms 6 --warmup_steps 2 --no-compile --no_history --no_progress" \
 "estimate -m hf --hf_config qwen3_moe --num_layers 4 -sl 4096 -mb 4 --configs none moe full_uniform_1" \
 "plan -m hf --hf_config qwen3_moe --num_layers 4 -sl 4096 -mb 4 --memory-budget 0.2GiB --verify -ms 5 --warmup_steps 2 --no_history --no_progress"; do
  echo; echo "\$ remat $cmd"; remat $cmd 2>&1 | grep -v "UserWarning\|warnings.warn\|^\[transformers\]"; echo "exit ${PIPESTATUS[0]}"
done
} > $OUT/cli_hf_cuda.txt
