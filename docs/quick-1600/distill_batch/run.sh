# Distillation batch size on this 2-core CPU: the same 384 prompts (drawn with seed 0 from the
# quick-1600 run's 1600) answered in batches of 32, then of 128. Run from the repository root:
#   bash docs/quick-1600/distill_batch/run.sh
set -e
for b in 32 128; do
  rm -rf runs/distill-batch-$b*
  s=$(date +%s.%N)
  .venv/bin/python -m medusa_train.distill --prompts docs/quick-1600/distill_batch/prompts.jsonl \
      --output runs/distill-batch-$b.jsonl --model smollm2-135m-instruct --max-new-tokens 192 \
      --batch-size $b --no-progress > /dev/null 2>&1
  e=$(date +%s.%N)
  echo "batch $b: $(echo "$e - $s" | bc) s, $(wc -l < runs/distill-batch-$b.jsonl) rows"
done
.venv/bin/python - <<'PY'
import json
a, b = ({json.loads(x)["id"]: json.loads(x)["response"] for x in open(f"runs/distill-batch-{n}.jsonl")}
        for n in (32, 128))
print(f"identical answers: {sum(a[k] == b[k] for k in a)} of {len(a)}")
PY
