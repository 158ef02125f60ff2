#!/bin/bash
# The arm64 (GH200) image, built and run on this amd64 machine under QEMU emulation: the proof issue 55 asks for,
# run once and recorded in docs/benchmarks.md ("The arm64 image"); too slow for every CI run.
#
#   sudo bash bench/arm64_image.sh [OUT_DIR]      (default /tmp/scalelm-arm64; about an hour on 2 cores, cold)
#
# 1. a real Apptainer (.ci/apptainer/setup.sh) and arm64 emulation (.ci/apptainer/emulation.sh on arm64,
#    undone at the end: the script says what it registers);
# 2. the base images for amd64 and arm64 (.ci/apptainer/make-base-image.sh [--arch arm64]), then the project's
#    image on each (`scalelm container build [--arch arm64]`); the arm64 one's SIF header and labels read back;
# 3. `apptainer test` of the arm64 image (python -m scalelm.selftest, emulated);
# 4. the same 2-rank DDP training of a tiny model (the shipped WikiText-2 sample, 8 steps, a checkpoint at 4 and 8)
#    in each image, the arm64 one through the launcher with --allow-emulation (and refused without it);
# 5. each run consolidated and evaluated in the amd64 image: the training losses step by step and the test loss
#    agree within fp32 tolerance (the model is the model, whatever the architecture and torch's build).
# Writes OUT_DIR/arm64.json (times, versions, losses, the comparison) and OUT_DIR/logs/.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(mkdir -p "${1:-/tmp/scalelm-arm64}" && cd "${1:-/tmp/scalelm-arm64}" && pwd)"
logs="$out/logs"
mkdir -p "$logs"
export PATH="${SCALELM_VENV:-$repo/.venv}/bin:$PATH"
export APPTAINER_TMPDIR="${APPTAINER_TMPDIR:-/dev/shm}"
cd "$repo"
[[ $(id -u) -eq 0 ]] || { echo "error: run as root (Apptainer's set-up, binfmt_misc)" >&2; exit 1; }

times="$out/times.txt"
: > "$times"
step() {  # step NAME COMMAND...: run it, its output in logs/NAME.log, its seconds in times.txt
    local name=$1 t0=$SECONDS
    shift
    echo "[$(date +%H:%M:%S)] $name" >&2
    if ! "$@" > "$logs/$name.log" 2>&1; then
        echo "error: $name failed; the end of $logs/$name.log:" >&2
        tail -n 40 "$logs/$name.log" >&2
        exit 1
    fi
    echo "$name $((SECONDS - t0))" >> "$times"
}

had_wrappers=0
[[ -x /usr/local/bin/apptainer ]] && had_wrappers=1
cleanup() {
    bash .ci/apptainer/emulation.sh off arm64 || true
    [[ $had_wrappers -eq 1 ]] || bash .ci/apptainer/teardown.sh || true
}
trap cleanup EXIT
step setup bash .ci/apptainer/setup.sh
step emulation bash .ci/apptainer/emulation.sh on arm64
cat "$logs/emulation.log" >&2

squash=(--build-option=--mksquashfs-args "--build-option=-comp zstd -Xcompression-level 3")
for arch in amd64 arm64; do
    step "base_$arch" bash .ci/apptainer/make-base-image.sh --arch "$arch" "$out/base-$arch.sif"
    step "image_$arch" python -m scalelm.launch.container build --definition containers/scalelm.def \
        --out "$out/scalelm-$arch.sif" --base-image "$out/base-$arch.sif" --no-fakeroot --arch "$arch" "${squash[@]}"
done
apptainer sif header "$out/scalelm-arm64.sif" > "$logs/header_arm64.log"
apptainer inspect --json --labels "$out/scalelm-arm64.sif" > "$logs/labels_arm64.json"
step selftest_arm64 apptainer test "$out/scalelm-arm64.sif"

# the tiny training: the shipped sample, prepared on the host
data="$out/data"
rm -rf "$data" "$out"/run-*
sample=resources/wikitext-2-sample
python -m scalelm.data.prefetch --out "$data/raw" \
    --files "train=$sample/train.txt,validation=$sample/validation.txt,test=$sample/test.txt" > "$logs/data.log" 2>&1
python -m scalelm.data.prepare --raw "$data/raw" --out "$data/prepared" --min-freq 2 >> "$logs/data.log" 2>&1
for arch in amd64 arm64; do
    cat > "$out/train-$arch.yaml" <<EOF
run_dir: $out/run-$arch
device: cpu
data: {prepared_dir: $data/prepared, seq_len: 16}
model: {d_model: 32, n_heads: 2, n_layers: 2, d_ff: 64, dropout: 0.0}
batch: {mode: global, size: 16}
parallel: {strategy: ddp}
train: {epochs: 1, max_steps: 8, log_every: 1, eval_every: 4, monitor_interval_s: 0}
checkpoint: {every: 4, keep: 2}
EOF
done
launch=(python -m scalelm.launch --procs-per-node 2 --bind "$out")
# an amd64 node refuses the arm64 image unless emulation is allowed
if "${launch[@]}" --container "$out/scalelm-arm64.sif" -- --config "$out/train-arm64.yaml" > "$logs/refused.log" 2>&1; then
    echo "error: the launcher ran the arm64 image without --allow-emulation" >&2
    exit 1
fi
grep -q "built for arm64" "$logs/refused.log"
step train_amd64 "${launch[@]}" --container "$out/scalelm-amd64.sif" -- --config "$out/train-amd64.yaml"
step train_arm64 "${launch[@]}" --container "$out/scalelm-arm64.sif" --allow-emulation -- \
    --config "$out/train-arm64.yaml"
for arch in amd64 arm64; do
    step "evaluate_$arch" apptainer exec --cleanenv --bind "$out" "$out/scalelm-amd64.sif" \
        python -m scalelm.train.evaluation --consolidate "$out/run-$arch" --model "$out/run-$arch/model.pt" \
        --data "$data/prepared" --split test --out "$out/run-$arch/test.json"
done

python - "$out" <<'EOF'
import json, math, sys
from pathlib import Path

out = Path(sys.argv[1])
times = dict(line.split() for line in (out / "times.txt").read_text().splitlines())
labels = json.loads((out / "logs/labels_arm64.json").read_text())["data"]["attributes"]["labels"]
header = (out / "logs/header_arm64.log").read_text()
runs = {}
for arch in ("amd64", "arm64"):
    run = out / f"run-{arch}"
    record = json.loads((run / "run.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    runs[arch] = {
        "torch": record["versions"]["torch"],
        "architecture": record["device"]["architecture"],
        "train_loss": {m["step"]: m["loss"] for m in metrics if m["kind"] == "train"},
        "test_loss": json.loads((run / "test.json").read_text())["loss"],
    }
a, b = runs["amd64"], runs["arm64"]
steps = sorted(a["train_loss"])
worst = max(abs(a["train_loss"][s] - b["train_loss"][s]) / a["train_loss"][s] for s in steps)
test = abs(a["test_loss"] - b["test_loss"]) / a["test_loss"]
result = {
    "times_s": {k: int(v) for k, v in times.items()},
    "arm64_image": {"header_arch": next(l.split()[-1] for l in header.splitlines() if "Primary Architecture" in l),
                    "label_architecture": labels["org.scalelm.architecture"],
                    "label_torch": labels["org.scalelm.torch-version"]},
    "runs": runs,
    "steps": steps,
    "max_relative_train_loss_difference": worst,
    "relative_test_loss_difference": test,
    "tolerance": 1e-4,
}
(out / "arm64.json").write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
assert result["arm64_image"]["header_arch"] == "arm64" and labels["org.scalelm.architecture"] == "aarch64"
assert b["architecture"] == "aarch64" and a["architecture"] == "x86_64", runs
assert len(steps) == 8 and worst <= 1e-4 and test <= 1e-4 and math.isfinite(b["test_loss"]), (worst, test)
print(f"arm64 == amd64: train losses within {worst:.1e}, test loss within {test:.1e} (relative)")
EOF
