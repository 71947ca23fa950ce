#!/usr/bin/env bash
# The GPU checks for a session lent one GPU with no package index (Python 3.12, PyTorch,
# transformers; no Ray, no vLLM): run from the repository root there, with the Ray bundle of
# ../shared/tools/gpu-bundle.sh carried in .gpu-bundle/.
#
#   benchmarks/gpu_session.sh [STEPS] [RESPONSE_TOKENS]     (defaults: 20, 256)
#
# 1. the GPU-marked tests that need no vLLM (`-m "gpu and not vllm"`: one-GPU ones run, the
#    two-GPU ones skip; test_layout.py needs grimp, a dev tool not there), in the
#    background, with their own Ray;
# 2. at the same time, `avrid ppo --preset qwen-gsm8k --set rollout.engine=torch` for STEPS
#    steps on a Qwen2.5-0.5B-shaped random model (benchmarks/qwen_shape.py), with the GPU's
#    memory sampled every 0.5 s by nvidia-smi.
# Logs and metrics go to $OUT (the device tool brings them back), else to ./gpu-out.
set -uo pipefail
steps=${1:-20}; response=${2:-256}
out=${OUT:-gpu-out}; mkdir -p "$out"
mkdir -p /tmp/site && tar xJf .gpu-bundle/gpu-site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, ray; print('torch', torch.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)"

(timeout 240 python3 -m pytest tests -m "gpu and not vllm" -p no:cacheprovider -q -rA \
    --timeout 200 --ignore tests/test_layout.py > "$out/gpu_tests.log" 2>&1; echo "pytest exit $?" >> "$out/gpu_tests.log") &
tests=$!

python3 benchmarks/qwen_shape.py /tmp/qs
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$out/gpu_mem_mib.txt" &
smi=$!
run=(--preset qwen-gsm8k --set rollout.engine=torch --set model.path=/tmp/qs/model
     --set model.tokenizer=/tmp/qs/tokenizer --set task.path=/tmp/qs/gsm8k.jsonl
     --set train.steps="$steps" --set train.prompts_per_step=16 --set train.mini_batch_size=64
     --set rollout.max_response_tokens="$response" --set train.val_every=10
     --set train.val_prompts=16 --set train.checkpoint_every=0 --set train.out_dir=/tmp/qrun)
python3 -m avrid.cli ppo "${run[@]}" --estimate-memory > "$out/estimate.txt" 2>&1
start=$(date +%s)
timeout 300 python3 -m avrid.cli ppo "${run[@]}" > "$out/qwen_run.log" 2>&1
echo "qwen run exit $? after $(( $(date +%s) - start )) s" | tee -a "$out/qwen_run.log"
kill $smi
cp /tmp/qrun/metrics.jsonl "$out/qwen_metrics.jsonl" 2>/dev/null
echo "peak GPU memory (MiB, nvidia-smi): $(sort -n "$out/gpu_mem_mib.txt" | tail -1)"
wait $tests
tail -25 "$out/gpu_tests.log"
tail -8 "$out/qwen_run.log"
