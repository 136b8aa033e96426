#!/usr/bin/env bash
# The GPU figures of the throughput issue in one run (one NVIDIA GPU, about 9 minutes), the key ones first:
#   1. `python3 -m benchmarks.throughput_reference` at llama-1b, bf16, micro-batch 8 x 1024: the plain compiled loop,
#      then unbroken (1 worker, compiled) with snapshot.every=0 and with snapshot.every=auto, side by side;
#      each job's metrics, events and logs kept in OUT_DIR/runs; then the auto row's first steps and writes.
#      STEPS (default 300) leaves the auto row a steady second half: its first writes map fresh shared
#      memory (about 10 s per 16 GB buffer, 60 steps; the second buffer is now mapped beside the first
#      write). The jobs' run directories go to /dev/shm (TMPDIR): each ends with a 16 GB final
#      checkpoint, which took 90 s on a GPU machine's disk (outside the measured steps either way);
#   2. fused AdamW bit-identical across workers, directly and through apply_step (scripts/gpu/fused_adamw.py);
#   3. the CUDA-only tests (placement, staging, auto snapshots staged on the device, completion);
#   4. `unbroken bench takeover` at the same shape: a covering worker's step (compile off and on) against a
#      normal worker's (compiled), per takeover policy;
#   5. a llama-1b snapshot's copy and write alone, as a worker of 8 and of 1 per node (snapshot_llama1b.py),
#      then again with the pinned memory registered on 8 threads (the first snapshot's allocation);
#   6. what a snapshot's write threads cost a launch-like training thread on this host
#      (`python3 -m benchmarks.snapshot_contention`: the snapshotter's reader against torch's copy_).
# Usage: bash scripts/gpu/throughput_llama1b.sh OUT_DIR [STEPS]
set -u
out=${1:?usage: throughput_llama1b.sh OUT_DIR [STEPS]}
steps=${2:-300}
mkdir -p "$out"
# 0. a CUDA job's workers forked from the node's template (a template holding torch's thread pool was never
#    forked on a GPU host before): a short job; should it fail, the rest runs with fresh worker processes
template=()
if ! timeout 120 python3 -m unbroken.cli train --preset debug --workers 1 --steps 5 --train.device=cuda \
        --out "$out/forked_cuda_job" --overwrite > "$out/forked_cuda_job.txt" 2>&1; then
    echo "a CUDA job with forked workers failed (tail of $out/forked_cuda_job.txt below): fault.template=false"
    tail -5 "$out/forked_cuda_job.txt"
    template=(--fault.template=false)
fi
grep -ho '"event":"worker_start"[^}]*"forked":[a-z]*' "$out"/forked_cuda_job/events/*.jsonl 2>/dev/null | tail -1
TMPDIR=/dev/shm python3 -m benchmarks.throughput_reference --preset llama-1b --precision bf16 --workers 1 \
    --steps "$steps" --plain compiled --plain-steps 20 --snapshots 0,auto --data.seq_len=1024 "${template[@]}" \
    --keep-logs "$out/runs" --out "$out/throughput_reference_llama1b.json" 2>&1 | grep -v "^\s*$" | tail -40
# the auto row's first steps: step 2 waited 9 s for one 16 GB pinned allocation before the staging was made of
# 64 MiB blocks (is it an ordinary step now?); and when its snapshots started to rest on a steady write
python3 - "$out/runs" <<'PY'
import json, pathlib, sys
for run in sorted(pathlib.Path(sys.argv[1]).glob("w1-sauto-*")):
    steps = {r["step"]: r["step_time_s"] for r in map(json.loads, open(run / "metrics.jsonl")) if r.get("kind") == "train"}
    sealed = [json.loads(l) for l in open(run / "events.jsonl") if '"snapshot_sealed"' in l]
    print(run.name, "steps 1-5 (s):", [round(steps.get(i, -1), 3) for i in range(1, 6)],
          "| first writes (step, write s):", [(e.get("step"), round(e.get("write_s", 0), 2)) for e in sealed[:4]])
PY
python3 scripts/gpu/fused_adamw.py 2>&1 | tail -1 | tee "$out/fused_adamw.json"
python3 -m pytest -q -rs -p no:cacheprovider tests/unit/test_cuda_placement.py tests/unit/test_snapshot_staging.py \
    tests/unit/test_collective_completion.py 2>&1 | tail -15
python3 -m unbroken.cli bench takeover --preset llama-1b --precision bf16 --data.seq_len=1024 --repeats 3 \
    --out "$out/takeover_llama1b.json" 2>&1 | tail -7
python3 scripts/gpu/snapshot_llama1b.py 2>&1 | tail -1 | tee "$out/snapshot_llama1b.json"
# the same with torch's host allocator registering pages on 8 threads: does the first snapshot's pinned
# allocation (9 s for 16 GB, the training thread's CUDA calls waiting) get shorter? (first_total_s)
PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 \
    python3 scripts/gpu/snapshot_llama1b.py 2>&1 | tail -1 | tee "$out/snapshot_llama1b_host_register.json"
python3 -m benchmarks.snapshot_contention --out "$out/snapshot_contention.json" 2>&1 \
    | grep -A4 '"slowdown"\|"write_gb_s"'
