#!/usr/bin/env bash
# The GPU proof kit, part 2: scalelm's command-line tools on one GPU (docs/gpu.md).
#
#   bash bench/gpu_smoke.sh OUTDIR          # one CUDA GPU, torch 2.11 or newer, no network, no install
#   bash bench/gpu_smoke.sh OUTDIR --cpu    # the same steps on CPU with a tiny model (CI); GPU-only ones N/A
#
# Runs the real CLI (python3 -m scalelm.train, .study.consolidate, .study.evaluate) into OUTDIR/runs, then
# bench/gpu_smoke_report.py prints one PASS/FAIL/N/A line per check with its figure and writes OUTDIR/smoke.json.
# Exit status: 1 if any check failed.
set -u -o pipefail
out=${1:?usage: bash bench/gpu_smoke.sh OUTDIR [--cpu]}
mode=${2:-gpu}
cd "$(dirname "$0")/.."
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
runs=$out/runs
mkdir -p "$runs"
: >"$out/status"

step() {  # step NAME COMMAND...: runs it, its output in OUTDIR/NAME.log, its exit status in OUTDIR/status
    local name=$1
    shift
    local start=$SECONDS
    "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - start))" >>"$out/status"
    echo "ran $name: exit $rc in $((SECONDS - start)) s"
}

train_command() {  # train_command RUN_NAME [--config FILE] SETTING...: sets `command`, a training run into runs/RUN_NAME
    local name=$1
    shift
    command=($py -m scalelm.train --set run_dir="$runs/$name" --set data.prepared_dir="$out/prepared")
    if [ "$1" = --config ]; then
        command+=(--config "$2")
        shift 2
    fi
    for setting in "$@"; do command+=(--set "$setting"); done
}

train() {  # train RUN_NAME [--config FILE] SETTING...: runs it
    train_command "$@"
    "${command[@]}"
}

$py -c "import sys; from pathlib import Path; from bench.throughput import make_prepared; make_prepared(Path(sys.argv[1]))" \
    "$out/prepared" || exit 1

if [ "$mode" = --cpu ]; then
    device=(device=cpu train.precision=fp32 model.d_model=64 model.n_heads=2 model.n_layers=1 model.d_ff=128 batch.size=16)
    steps=12 stop_steps=60 stop_after=10
else
    device=(device=cuda)
    steps=300 stop_steps=2000 stop_after=200
fi
common=(train.log_every=$((steps / 6)) train.monitor_interval_s=0.5 "${device[@]}")

# nvidia-smi's readings through every run, for the monitor's to be compared with (NVML both, sampled apart)
if [ "$mode" != --cpu ] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used,power.draw --format=csv,noheader,nounits \
        -lms 200 >"$out/nvidia_smi.csv" 2>/dev/null &
    smi=$!
    trap 'kill $smi 2>/dev/null' EXIT
fi

# 1. the course model in the device's precision (bf16 on CUDA): evaluation and checkpoint half-way, the profiled
#    collectives, the monitor
step course train course "${common[@]}" train.max_steps=$steps train.eval_every=$((steps / 2)) \
    checkpoint.every=$((steps / 2)) train.comm_profile_steps=2

# 2. fp32 (TF32 matmuls on CUDA) for the tokens/s and MFU beside bf16, and bf16 compiled
if [ "$mode" != --cpu ]; then
    step fp32 train fp32 "${common[@]}" train.precision=fp32 train.max_steps=100 checkpoint.every=null
    step course_compiled train course_compiled "${common[@]}" train.compile=true train.max_steps=$steps \
        checkpoint.every=null
fi

# 3. stop and resume: SIGUSR1 (Slurm's warning signal) after some steps -> checkpoint, exit 75; the rerun resumes
#    (stop_after: a logged step, a multiple of the run's log_every of 10)
train_command stop "${common[@]}" train.max_steps=$stop_steps train.log_every=10 checkpoint.every=null
"${command[@]}" >"$out/stop.log" 2>&1 &  # a simple command: $! is the training process itself
pid=$!
start=$SECONDS
until grep -q "\"step\": $stop_after," "$runs/stop/metrics.jsonl" 2>/dev/null || ! kill -0 $pid 2>/dev/null ||
    [ $((SECONDS - start)) -gt 180 ]; do sleep 0.2; done
kill -USR1 $pid 2>/dev/null
wait $pid
echo "stop $? $((SECONDS - start))" >>"$out/status"
step resume train stop "${common[@]}" train.max_steps=$stop_steps train.log_every=10 checkpoint.every=null

# 4. consolidation and evaluation on the CPU, of the course run trained on the device
step consolidate env CUDA_VISIBLE_DEVICES= $py -m scalelm.train.consolidate --run-dir "$runs/course"
step evaluate env CUDA_VISIBLE_DEVICES= $py -m scalelm.train.evaluation --model "$runs/course/model.pt" \
    --data "$out/prepared" --split test --out "$out/evaluate_test.json"

# 5. the gpt2_small experiment of config/config.yaml (GPT-2 small's shape), compiled as it is there, eager, and
#    compiled with selective activation checkpointing; on CPU a tiny model compiled
if [ "$mode" != --cpu ]; then
    $py -c "import sys, yaml; config = yaml.safe_load(open('config/config.yaml'))
yaml.safe_dump(config['experiments']['gpt2_small']['training'], open(sys.argv[1], 'w'))" "$out/gpt2_small.yaml"
    gpt2=(--config "$out/gpt2_small.yaml" device=cuda train.max_steps=60 train.log_every=10 train.comm_profile_steps=0
        checkpoint.every=null train.monitor_interval_s=0.5)
    step gpt2_compiled train gpt2_compiled "${gpt2[@]}"
    step gpt2_eager train gpt2_eager "${gpt2[@]}" train.compile=false
    step gpt2_recompute train gpt2_recompute "${gpt2[@]}" train.activation_checkpointing=selective
else
    step compiled train compiled "${common[@]}" train.max_steps=$steps train.compile=true checkpoint.every=null \
        train.comm_profile_steps=0
fi

[ -n "${smi:-}" ] && kill "$smi" 2>/dev/null
$py bench/gpu_smoke_report.py "$out" "$mode"
