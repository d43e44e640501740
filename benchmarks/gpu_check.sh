#!/usr/bin/env bash
# For a machine with an NVIDIA GPU and the real vllm (pip install -e ".[vllm]"): the vLLM / trainer
# parity check in fp32 with the adapter merged into vLLM's weights (--vllm-lora merge, the default) and
# with vLLM's LoRA kernels (--vllm-lora adapter), then a short async GRPO run with one vLLM worker
# (merged) beside the trainer on the same GPU; a GPU run resumed halfway against one never stopped. Prints the parity lines, the trainer's last metrics and
# the worker's publish time (merge + in-place reload + cache reset). The build machines have no GPU: the
# figures in README.md are from CPU runs unless stated otherwise.
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct STEPS=20 bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}
STEPS=${STEPS:-20}
OUT=${OUT:-runs/gpu-check}
COMMON=(--config configs/arith_grpo_cpu.yaml --model "$MODEL" --device cuda --vllm-mem 0.3)
for mode in merge adapter; do
  python train.py "${COMMON[@]}" --generator vllm --vllm-lora $mode --gen-dtype float32 --no-bf16 --check-parity
done
python train.py "${COMMON[@]}" --role trainer --port 8011 --steps "$STEPS" --eval-every 10 --out "$OUT" &
trainer=$!
python train.py "${COMMON[@]}" --role rollout --generator vllm --trainer-url http://127.0.0.1:8011 --out "$OUT-worker"
wait $trainer
python - "$OUT" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(f"{sys.argv[1]}/metrics.csv")))
steps = [float(b["time_s"]) - float(a["time_s"]) for a, b in zip(rows[1:-1], rows[2:-1])]
print("eval_acc:", [(r["step"], r["eval_acc"]) for r in rows if r.get("eval_acc")])
print("median s/step:", sorted(steps)[len(steps) // 2], " last logp_gap:", rows[-2].get("logp_gap"))
worker = [float(r["publish_s"]) for r in csv.DictReader(open(f"{sys.argv[1]}-worker/metrics.csv"))]
print("worker publish s (median):", sorted(worker)[len(worker) // 2])
PY
# Resume on a GPU samples as the uninterrupted run does: checkpoints keep the GPU's RNG state too.
R=(--config configs/arith_grpo_cpu.yaml --model "$MODEL" --device cuda --eval-every 0 --batch-size 8 --save-every 0)
python train.py "${R[@]}" --steps 4 --out "$OUT-whole" >/dev/null
python train.py "${R[@]}" --steps 2 --out "$OUT-half" >/dev/null && python train.py --resume "$OUT-half" --steps 4 >/dev/null
python - "$OUT" <<'PY'
import csv, sys
r = [[x["reward"] for x in csv.DictReader(open(f"{sys.argv[1]}-{d}/metrics.csv")) if x.get("reward")] for d in ("whole", "half")]
print("GPU resume, rewards of steps 0-3:", r[0], "resumed:", r[1], "same:", r[0] == r[1])
PY
# Data parallel over every GPU of the machine (one rank on a single GPU: the distributed path all the same, NCCL for
# GPU tensors and gloo for the CPU ones every step reduces), evaluations included.
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
torchrun --nproc-per-node "$GPUS" train.py "${COMMON[@]}" --steps 4 --eval-every 2 --out "$OUT-dp" >/dev/null
python - "$OUT-dp" <<'PY'
import csv, sys
print("data parallel:", [(r["step"], r.get("eval_acc"), r.get("loss")) for r in csv.DictReader(open(f"{sys.argv[1]}/metrics.csv"))])
PY
# FSDP over every GPU of the machine (benchmarks/scale.py's GPU variant): parameters per rank, s/step.
if [ "$GPUS" -ge 2 ]; then
  torchrun --nproc-per-node "$GPUS" train.py "${COMMON[@]}" --fsdp --steps 10 --eval-every 0 --out "$OUT-fsdp" \
    | grep "parameters on each"
  python - "$OUT-fsdp" <<'PY'
import csv, sys
t = [float(r["time_s"]) for r in csv.DictReader(open(f"{sys.argv[1]}/metrics.csv")) if r.get("reward")]
print("FSDP median s/step:", sorted(b - a for a, b in zip(t, t[1:]))[len(t) // 2 - 1])
PY
fi
