#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, stage by stage: the one way to run a benchmark stage. Each
# stage fits in about ten minutes on one H100 with 16 cores and 125 GiB of host RAM; run several in
# one go where time allows. On an offline GPU machine `../shared/device/gpu-call.sh STAGE...` unpacks
# Ray (and DeepSpeed) there and calls this script with STAGE_TIMEOUT_S and PACK_INTO set.
#
#   bash jobs/bench_matrix.sh OUT_DIR STAGE [STAGE ...]
#
# Stages:
#   cuda-tests  the engine's CUDA tests (streams, pinned arena, bf16 curve, memory within the
#               searched budget, the traced activation peak against the allocator's), and FSDP2
#               offload as the benchmark builds it following plain PyTorch from the same weights
#   ray-gpu     a Ray run on the GPU (NCCL, one worker, gpt-124m at a 2 GiB budget: device and host
#               chunks, CPU AdamW and Deep Optimizer States), its worker SIGKILLed at step 15 and the
#               run recovered from the object store (jobs/bench_recovery.py)
#   host-adam   the engine's CPU AdamW alone and beside a busy training thread, per update thread
#               count, through the one-pass C kernel (its threads claiming blocks, and an even share each)
#               and torch's passes (jobs/bench_host_adam.py; about 45 s)
#   compute     the planner's compute prediction against a measured plain step (gpt-1.5b, gpt-4b)
#   gpt-1.5b    plain PyTorch (uncapped) and elixir_ray capped at 24 GiB
#   gpt-1.5b-40 the same capped at 40 GiB, and gpt-1.5b-16 at 16 GiB (the engine's and the
#               planner's memory acceptance budgets)
#   gpt-4b-40   plain PyTorch and elixir_ray, gpt-4b capped at 40 GiB
#   gpt-4b-24   plain PyTorch and elixir_ray, gpt-4b capped at 24 GiB
#   gpt-4b-16   plain PyTorch and elixir_ray, gpt-4b capped at 16 GiB (the planner's third budget)
#   gpt-4b-margin  plain PyTorch once and elixir_ray at 40 and 24 GiB, its plans keeping 10% of the
#               cap back instead of 20%, every process on the allocator's expandable segments (the
#               reserved bytes and retries say whether the smaller margin holds)
#   gpt-1.5b-margin  the same for gpt-1.5b at 24 and 16 GiB (the 24 GiB target, and whether 10% holds
#               at the smallest cap)
#   gpt-4b-caps, gpt-1.5b-caps  plain PyTorch once and elixir_ray at 40, 24 and 16 GiB, in one run (the
#               three stages of each shape above, two references fewer)
#   gpt-4b-40-24  plain PyTorch once and elixir_ray at 40 and 24 GiB: the two gpt-4b targets in one run
#   fsdp2-24    plain PyTorch and FSDP2 offload alone, gpt-4b capped at 24 GiB
#   numerics    300 steps of gpt-124m on real text (the standard-library corpus, a new batch each
#               step): plain PyTorch under autocast, elixir_ray at its defaults capped at 4 GiB (host
#               chunks and CPU updates), and FSDP2 offload with bf16 parameters; every step's loss,
#               the final losses against the reference's, and bench-loss.png
#   gpt-15b     elixir_ray alone on the 15.4B GPT, at the device's free memory (its state does not fit
#               on the device or on the host alone), 4 timed steps
#   peers-24    plain PyTorch, FSDP2 offload and DeepSpeed ZeRO-3 offload, gpt-4b capped at 24 GiB
#   deepspeed-24  plain PyTorch and DeepSpeed ZeRO-3 offload alone, the same shape and cap (DeepSpeed
#               builds its CPU Adam first, about a minute)
#   gpt-4b-24-all  gpt-4b-24 and peers-24 in one run: plain PyTorch, elixir_ray, FSDP2 offload and
#               DeepSpeed ZeRO-3 offload (one reference for all four, a minute less than the two stages)
#   gpt-4b-24-all-margin  the same with elixir_ray's plan keeping 10% of the cap back and every
#               process on expandable segments, as gpt-4b-margin (DeepSpeed last: it alone may need
#               four minutes, so give the stage eight)
#   gpt-4b-24-fsdp2-pageable  plain PyTorch, elixir_ray (as gpt-4b-24-all-margin) and FSDP2 offload to
#               pageable host memory (blocking gradient copies, --fsdp2-pageable): the FSDP2 to compare
#               with where cuda-tests finds the pinned one's training apart from plain PyTorch's and the
#               pageable one's not
#   plans-24    the searched plan against the hand-made ones, gpt-4b capped at 24 GiB
#   gpt-10b     elixir_ray alone on the 10.3B GPT capped at 70 GiB (the reference does not fit)
#
# The machine (GPU, driver, Python and torch, cores, memory) goes to OUT_DIR/machine.txt before the
# first stage. Each stage writes OUT_DIR/STAGE/ (JSON, markdown, PNG where the tool makes one) and a
# log; each system's (or plan's) result is written as soon as it finishes, so a stage stopped midway
# keeps them. Python is `python3` unless PYTHON is set; the repository root must be importable.
#
# Environment:
#   STAGE_TIMEOUT_S  stop each stage (its whole process group) after this many seconds (default 0: no
#                    limit); it applies per stage, so a remote command's own limit must cover the stages
#                    it runs, each plus up to 20 s to stop
#   PACK_INTO        after each stage, also pack OUT_DIR/STAGE into PACK_INTO/STAGE.tgz (and copy
#                    machine.txt there): one file per stage, for a transfer that brings back only a few files
# Relative OUT_DIR and PACK_INTO are taken from the directory the script is called from.
set -uo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
[ -n "${PACK_INTO:-}" ] && PACK_INTO="$(absolute "$PACK_INTO")"
if [ $# -ge 1 ] && [ "$1" != "--one-stage" ]; then set -- "$(absolute "$1")" "${@:2}"; fi
if ! [[ "${STAGE_TIMEOUT_S:-0}" =~ ^[0-9]+$ ]]; then
    echo "STAGE_TIMEOUT_S must be a whole number of seconds, got '$STAGE_TIMEOUT_S'"
    exit 2
fi
cd "$(dirname "$self")/.."
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
stages="cuda-tests ray-gpu host-adam compute gpt-1.5b gpt-1.5b-40 gpt-1.5b-16 gpt-4b-40 gpt-4b-40-24 fsdp2-24 numerics gpt-15b gpt-4b-margin gpt-1.5b-margin gpt-4b-24 gpt-4b-16 gpt-4b-caps gpt-1.5b-caps peers-24 deepspeed-24 gpt-4b-24-all gpt-4b-24-all-margin gpt-4b-24-fsdp2-pageable plans-24 gpt-10b"

stage_command() {
    local stage="$1" dir="$2"
    case "$stage" in
        cuda-tests) "$PY" -m pytest -q -s -p no:cacheprovider tests/test_engine_cuda.py tests/test_bench_peers.py ;;
        ray-gpu) "$PY" jobs/bench_recovery.py --config jobs/configs/tiny.yaml --steps 30 --every 10 --kill-at 15 \
                     --kill-rank 0 --set cluster.num_workers=1 --set cluster.cpus_per_worker=8 \
                     --set model.size=gpt-124m --set model.vocab_size=257 --set engine.device_memory=2GiB \
                     --out "$dir/recovery.json" ;;
        host-adam) "$PY" jobs/bench_host_adam.py --out "$dir/host_adam.json" ;;
        compute) "$PY" jobs/bench_compute.py --out "$dir/compute.json" ;;
        gpt-1.5b) "$PY" jobs/bench.py --shape gpt-1.5b --cap 24GiB --systems reference elixir_ray --out "$dir" ;;
        gpt-1.5b-40) "$PY" jobs/bench.py --shape gpt-1.5b --cap 40GiB --systems reference elixir_ray --out "$dir" ;;
        gpt-1.5b-16) "$PY" jobs/bench.py --shape gpt-1.5b --cap 16GiB --systems reference elixir_ray --out "$dir" ;;
        gpt-4b-40) "$PY" jobs/bench.py --shape gpt-4b --cap 40GiB --systems reference elixir_ray --out "$dir" ;;
        gpt-4b-margin) "$PY" jobs/bench.py --shape gpt-4b --cap 40GiB 24GiB --systems reference elixir_ray \
                      --memory-margin 0.1 --alloc-conf expandable_segments:True --out "$dir" ;;
        gpt-1.5b-margin) "$PY" jobs/bench.py --shape gpt-1.5b --cap 24GiB 16GiB --systems reference elixir_ray \
                      --memory-margin 0.1 --alloc-conf expandable_segments:True --out "$dir" ;;
        gpt-4b-40-24) "$PY" jobs/bench.py --shape gpt-4b --cap 40GiB 24GiB --systems reference elixir_ray --out "$dir" ;;
        fsdp2-24) "$PY" jobs/bench.py --shape gpt-4b --cap 24GiB --systems reference fsdp2_offload --out "$dir" ;;
        numerics) "$PY" jobs/bench.py --shape gpt-124m --data builtin --warmup 0 --steps 300 --cap 4GiB \
                      --systems reference elixir_ray fsdp2_offload --out "$dir" ;;
        gpt-15b) "$PY" jobs/bench.py --shape gpt-15b --systems elixir_ray --steps 4 --out "$dir" ;;
        gpt-4b-24) "$PY" jobs/bench.py --shape gpt-4b --cap 24GiB --systems reference elixir_ray --out "$dir" ;;
        gpt-4b-16) "$PY" jobs/bench.py --shape gpt-4b --cap 16GiB --systems reference elixir_ray --out "$dir" ;;
        gpt-4b-caps) "$PY" jobs/bench.py --shape gpt-4b --cap 40GiB 24GiB 16GiB --systems reference elixir_ray --out "$dir" ;;
        gpt-1.5b-caps) "$PY" jobs/bench.py --shape gpt-1.5b --cap 40GiB 24GiB 16GiB --systems reference elixir_ray \
                      --out "$dir" ;;
        peers-24) "$PY" jobs/bench.py --shape gpt-4b --cap 24GiB --systems reference fsdp2_offload deepspeed_z3_offload \
                      --out "$dir" ;;
        deepspeed-24) "$PY" jobs/bench.py --shape gpt-4b --cap 24GiB --systems reference deepspeed_z3_offload \
                      --out "$dir" ;;
        gpt-4b-24-all) "$PY" jobs/bench.py --shape gpt-4b --cap 24GiB \
                      --systems reference elixir_ray fsdp2_offload deepspeed_z3_offload --out "$dir" ;;
        gpt-4b-24-all-margin) "$PY" jobs/bench.py --shape gpt-4b --cap 24GiB \
                      --systems reference elixir_ray fsdp2_offload deepspeed_z3_offload \
                      --memory-margin 0.1 --alloc-conf expandable_segments:True --out "$dir" ;;
        gpt-4b-24-fsdp2-pageable) "$PY" jobs/bench.py --shape gpt-4b --cap 24GiB \
                      --systems reference elixir_ray fsdp2_offload --fsdp2-pageable \
                      --memory-margin 0.1 --alloc-conf expandable_segments:True --out "$dir" ;;
        plans-24) "$PY" jobs/bench_plans.py --shape gpt-4b --cap 24GiB --steps 4 --out "$dir/plans.json" ;;
        gpt-10b) "$PY" jobs/bench.py --shape gpt-10b --cap 70GiB --systems elixir_ray --steps 4 --out "$dir" ;;
    esac
}

if [ "${1:-}" = "--one-stage" ]; then  # how run_stage runs one stage under STAGE_TIMEOUT_S
    stage_command "$2" "$3"
    exit $?
fi

if [ $# -lt 2 ]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$self"
    exit 2
fi
out="$1"; shift
for stage in "$@"; do  # every stage named is checked before any runs
    case " $stages " in
        *" $stage "*) ;;
        *) echo "unknown stage: $stage (choose from: $stages)"; exit 2 ;;
    esac
done

run_stage() {
    local stage="$1" dir="$out/$1" rc
    # a stage run again (on a machine kept warm between calls) must not pack the last run's results
    rm -rf "$dir" && mkdir -p "$dir"
    echo "== $stage ($(date -u +%H:%M:%S))"
    if [ "${STAGE_TIMEOUT_S:-0}" -gt 0 ]; then
        # timeout signals the stage's whole process group: the measured processes it started go too
        timeout --kill-after=20 "$STAGE_TIMEOUT_S" bash "$self" --one-stage "$stage" "$dir" 2>&1 | tee "$dir/log.txt"
    else
        stage_command "$stage" "$dir" 2>&1 | tee "$dir/log.txt"
    fi
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "== $stage stopped after STAGE_TIMEOUT_S=$STAGE_TIMEOUT_S s" | tee -a "$dir/log.txt"
    fi
    echo "== $stage exited $rc ($(date -u +%H:%M:%S))"
    if [ -n "${PACK_INTO:-}" ]; then  # under a temporary name first: never half an archive
        mkdir -p "$PACK_INTO" && tar czf "$PACK_INTO/.$stage.tgz.tmp" -C "$out" "$stage" \
            && mv "$PACK_INTO/.$stage.tgz.tmp" "$PACK_INTO/$stage.tgz" || { echo "== packing $stage failed"; rc=1; }
    fi
    return "$rc"
}

record_machine() {  # what the figures depend on, beside them
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "gpu", torch.cuda.is_available())' 2>&1
    nproc; free -g | sed -n 2p
    lscpu 2>/dev/null | grep -E "^(Model name|Socket|Core|Thread|CPU\(s\)|CPU max MHz|NUMA node\(s\))" || true
}
mkdir -p "$out" && record_machine > "$out/machine.txt"
[ -n "${PACK_INTO:-}" ] && mkdir -p "$PACK_INTO" && cp "$out/machine.txt" "$PACK_INTO/machine.txt"

status=0
for stage in "$@"; do
    run_stage "$stage" || status=1
done
exit "$status"
