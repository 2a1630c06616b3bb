#!/bin/bash
# Head variants on the demo's own 1600 distilled answers and kept states (after `make demo` at
# 6c78e46 or later: runs/demo/data/distilled.jsonl and its .hidden folder, runs/demo/features),
# everything else as in recipes/smollm2-135m.yaml. These ran at 971b81a, when the recipe's
# projection was `shared`; since 55e2f0b it is `own`, so the overrides below name it where it
# differs. Each run prints its held-out table (the files beside this script, by name).
set -e
D=${D:-runs/demo}
run() {
  name=$1; shift
  python train_heads.py --config recipes/smollm2-135m.yaml output_dir=runs/arch-$name \
    data.rows=$D/data/distilled.jsonl features.dir=$D/features eval.datastore=false "$@" > runs/arch-$name.log 2>&1
  { grep -A5 "head  positions" runs/arch-$name.log; grep "stage seconds" runs/arch-$name.log; } > docs/projection/$name.txt
}
run l2 heads.projection=shared heads.num_layers=2
run kl heads.projection=shared training.loss=kl
run own1
run ownl2 heads.num_layers=2
run owne3 training.epochs=3
run ownwd training.weight_decay=0.1
# These two ran later, at 304c3ea (the recipe's loss still ce then; since d80f89b
# it is kl, so `run ownce training.loss=ce` is the own1 run above).
run ownkl training.loss=kl
run ownkl-l2 training.loss=kl heads.num_layers=2
