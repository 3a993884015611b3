#!/usr/bin/env bash
# model.fp8 on one GPU, against bf16 in the same call: Flow-GRPO's recipe (benchmarks/e2e_recipe.py,
# a random SD3.5-Medium, 3 steps: 1 warm-up + 2 measured, the same seeds) in bf16, with
# model.fp8=all (rowwise and tensorwise scales) and with model.fp8=sampling, then the recipe's GEMM
# shapes one by one (benchmarks/fp8_gemms.py, its arguments from FP8_GEMMS_ARGS). The GEMM
# comparison with torchao's linear needs torchao (pip install 'diffrl[fp8]').
#
#   benchmarks/fp8_compare.sh OUT_DIR [BUDGET_S]
#
# Each run has its own timeout within BUDGET_S (default 570 s) so that a slow float8 compile cannot
# lose the others' numbers; the float8 runs log dynamo's recompiles and graph breaks (TORCH_LOGS). OUT_DIR
# gets each run's JSON line (<run>.json), its stderr (<run>.err), metrics.jsonl and plan.json,
# gemms.json, and the summary printed at the end: images/s, seconds per image and MFU per phase,
# compile time, peak memory, loss, grad norm, ratio_std and clipfrac per step, and the sampler's
# log-prob gap to the trainer (rollout_correction/*, logged where the old log-probs are recomputed).
set -u
out=${1:?usage: benchmarks/fp8_compare.sh OUT_DIR [BUDGET_S]}
budget=${2:-570}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export FP8_COMPARE_OUT=$out
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader
python -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__, 'cc', torch.cuda.get_device_capability())" 2>&1 | tail -1
run() { # name timeout_s args...
  local name=$1 t=$2; shift 2
  if (( t < 60 )); then echo "$name skipped: ${t}s left"; return; fi
  timeout $t python benchmarks/e2e_recipe.py --recipe flow_grpo --model /tmp/sd35m --warmup 1 --steps 2 \
    --out /tmp/e2e_$name "$@" > $out/$name.json 2> $out/$name.err
  echo "$name rc=$? at ${SECONDS}s"; tail -c 400 $out/$name.err | tr '\r' '\n' | tail -4
  for f in /tmp/e2e_$name/*/metrics.jsonl /tmp/e2e_$name/*/plan.json; do [[ -f $f ]] && cp $f $out/${name}_$(basename $f); done
}
left() { echo $(( budget - SECONDS )); }
cap() { echo $(( $(left) < $1 ? $(left) : $1 )); }
# FP8_RUNS picks the runs (all four by default), e.g. FP8_RUNS="bf16 fp8_all fp8_all_tensorwise";
# FP8_GEMMS=0 skips fp8_gemms.py
runs=" ${FP8_RUNS:-bf16 fp8_all fp8_all_tensorwise fp8_sampling} "
[[ $runs == *" bf16 "* ]] && run bf16 200
[[ $runs == *" fp8_all "* ]] && TORCH_LOGS=recompiles,graph_breaks run fp8_all $(cap 200) --set model.fp8=all
[[ $runs == *" fp8_all_tensorwise "* ]] && TORCH_LOGS=recompiles,graph_breaks run fp8_all_tensorwise $(cap 200) \
  --set model.fp8=all model.fp8_scaling=tensorwise
[[ $runs == *" fp8_sampling "* ]] && TORCH_LOGS=recompiles,graph_breaks run fp8_sampling $(cap 200) --set model.fp8=sampling
if [[ ${FP8_GEMMS:-1} == 1 ]] && (( $(left) > 45 )); then
  timeout $(left) python benchmarks/fp8_gemms.py ${FP8_GEMMS_ARGS:-} > $out/gemms.json 2> $out/gemms.err; echo "gemms rc=$? at ${SECONDS}s"
fi
python - <<'EOF'
import json, os
out = os.environ["FP8_COMPARE_OUT"]
def last(name):
    try:
        return json.loads(open(f"{out}/{name}.json").read().strip().splitlines()[-1])
    except Exception as e:
        return {"error": repr(e)[:200]}
r3 = lambda xs: [None if x is None else float(f"{x:.4g}") for x in xs] if isinstance(xs, list) else xs
for name in ("bf16", "fp8_all", "fp8_all_tensorwise", "fp8_sampling"):
    if not os.path.exists(f"{out}/{name}.json"):
        continue
    d = last(name)
    if "flow_grpo" not in d:
        print(name, d); continue
    f = d["flow_grpo"]
    print(f"{name}: fp8={f.get('fp8')} torchao={d.get('torchao')} {f['images_per_s_per_gpu']:.3f} images/s, steps {f['step_s_each']} s, "
          f"compile {f['compile_s']:.0f} s, peak {f['peak_mem_gib']:.1f} GiB, old log-probs recomputed {f['old_log_probs_recomputed']}")
    print("   per image s", {k: round(v, 4) for k, v in f["per_image_s"].items() if v}, "mfu", {k: round(v, 3) for k, v in f["mfu"].items()})
    print("   loss", r3(f["loss"]), "grad_norm", r3(f["grad_norm"]), "ratio_std", r3(f["ratio_std"]), "clipfrac", r3(f["clipfrac"]))
    print("   rollout_correction", {k: r3(v) for k, v in f.get("rollout_correction", {}).items()})
g = last("gemms")
for shape, s in g.get("shapes", {}).items():
    modes = sorted({k[: -len("_fwd_ms")] for k in s if k.endswith("_fwd_ms")} - {"bf16"})
    print(f"gemm {shape} (M {s['M']}, K {s['K']}, N {s['N']}): bf16 fwd {s['bf16_fwd_ms']} ms, fwd+bwd {s['bf16_fwd_bwd_ms']} ms")
    for m in modes:
        print(f"   {m}: fwd x{s[m + '_fwd_speedup']}, fwd+bwd x{s[m + '_fwd_bwd_speedup']}, rel err {s[m + '_rel_error']}")
EOF
echo "done at ${SECONDS}s"
