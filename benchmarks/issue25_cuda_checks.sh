#!/usr/bin/env bash
# Issue 25's last CUDA checks, from the repo root on the device machine: core_attn under flex
# attention through remat.run.verify (saved bytes counted by the allocator), the HF Llama benchmark
# under flex attention (trace, plans, predicted against measured peak), and the HF CLI runs
# (estimate --target cuda on torch 2.11, plan on an MoE model). Writes under $OUT.
export PYTHONPATH=src:tests:benchmarks
{
python -m pytest -q -p no:cacheprovider tests/unit/models/test_hf.py -k "attention_implementation" 2>&1 | tail -3
} > $OUT/flex_verify.txt
python benchmarks/hf_llama.py --attention flex_attention --layers 2 --seq 2048 --mb 2 --budgets 3.5 \
    --name hf_llama_flex_smoke 2>&1 | grep -v Warn | tail -12
bash benchmarks/cli_hf_cuda.sh
