#!/usr/bin/env bash
# Shapes runs side by side at GPU scale, validated on both splits, then their checkpoints' group
# diagnostics and the curves (docs/shapes.md, "Does a recipe hold at GPU scale?").
#
#   benchmarks/shapes_collapse.sh VARIANTS_FILE OUT_DIR TRAIN_SECONDS [STEPS] [VAL_EVERY]
#
# VARIANTS_FILE: one run per line, `name preset key=value ...` (# starts a comment). Every run
# starts at once, as its own process (`benchmarks/shapes_algorithms.py PRESET --split both`:
# 512 images a step, VAL_PER_CATEGORY rows (64) per category of each split, 2 validation samples
# per row, a checkpoint every 20 steps). A run that has not finished its STEPS (default 200)
# after TRAIN_SECONDS is stopped; its metrics.jsonl, validations and checkpoints so far stay.
# Then `benchmarks/shapes_groups.py` samples GROUP_PROMPTS (2) prompts per category and split,
# 16 images each, from the base, the checkpoints at the validation peaks and the last checkpoint
# of every run (side by side too), and `benchmarks/shapes_curves.py` writes OUT_DIR/curves.md,
# curves.json and the plots OUT_DIR/curves_{train,heldout}.png. Runs side by side share the GPU:
# compare their curves per step, not their speed.
#
# Extra overrides for every run: RUN_OVERRIDES="key=value ...". Tiny CPU check of the whole path:
#   RUN_OVERRIDES="data.prompts_per_step=2 rollout.n=2 rollout.micro_batch_size=4 \
#     actor.mini_batch_size=4 actor.micro_batch_size=4 trainer.save_freq=1" VAL_PER_CATEGORY=1 \
#     GROUP_PROMPTS=1 GROUP_N=2 benchmarks/shapes_collapse.sh VARIANTS runs/collapse_check 600 2 1
set -uo pipefail
if (($# < 3)); then
  sed -n '2,/^set /p' "$0" | sed '$d' >&2
  exit 2
fi
variants=$1 out=$2 train_s=$3 steps=${4:-200} val_every=${5:-20}
[[ -f $variants ]] || { echo "shapes_collapse.sh: no variants file $variants" >&2; exit 2; }
mkdir -p "$out/runs"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
names=()
while read -r name preset overrides; do
  [[ -z ${name:-} || $name == \#* ]] && continue
  names+=("$name")
  # shellcheck disable=SC2086  # overrides: one key=value per word
  timeout -k 30 -s TERM "$train_s" python3 benchmarks/shapes_algorithms.py "$preset" --steps "$steps" \
    --split both --val-every "$val_every" --val-per-category "${VAL_PER_CATEGORY:-64}" \
    --out "$out/runs" --json-out "$out/runs/$name.json" -- \
    rollout.val.n=2 trainer.run_name="$name" trainer.save_freq=20 trainer.keep_checkpoints=100 \
    ${RUN_OVERRIDES:-} $overrides >"$out/runs/$name.log" 2>&1 &
done <"$variants"
wait
for name in "${names[@]}"; do
  echo "$name: last logged step $(tail -1 "$out/runs/$name/metrics.jsonl" 2>/dev/null | cut -c1-20)"
  tail -2 "$out/runs/$name.log" | cut -c1-300
done
for name in "${names[@]}"; do
  [[ -d $out/runs/$name/validation ]] || continue
  python3 benchmarks/shapes_groups.py "$out/runs/$name" --steps 0 peak last \
    --per-category "${GROUP_PROMPTS:-2}" --n "${GROUP_N:-16}" >"$out/runs/$name.groups.log" 2>&1 &
done
wait
runs=() shown=()
for name in "${names[@]}"; do
  [[ -d $out/runs/$name/validation ]] && runs+=("$out/runs/$name") && shown+=("$name")
done
python3 benchmarks/shapes_curves.py "${runs[@]}" --names "${shown[@]}" --out "$out/curves.md" \
  --json-out "$out/curves.json" --plot-dir "$out"
cat "$out/curves.md"
