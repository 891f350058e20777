#!/usr/bin/env bash
# The GPU figures of docs/BENCHMARKS.md, stage by stage (each stage fits in about ten minutes on
# one H100 with 16 cores and 125 GiB of host RAM; run several in one go where time allows).
#
#   bash jobs/bench_matrix.sh OUT_DIR STAGE [STAGE ...]
#
# Stages:
#   cuda-tests  the engine's CUDA tests (streams, pinned arena, bf16 curve, memory within the
#               searched budget, the traced activation peak against the allocator's)
#   compute     the planner's compute prediction against a measured plain step (gpt-1.5b, gpt-4b)
#   gpt-1.5b    plain PyTorch (uncapped) and elixir_ray capped at 24 GiB
#   gpt-4b-40   plain PyTorch and elixir_ray, gpt-4b capped at 40 GiB
#   gpt-4b-24   plain PyTorch and elixir_ray, gpt-4b capped at 24 GiB
#   gpt-4b-16   plain PyTorch and elixir_ray, gpt-4b capped at 16 GiB (the planner's third budget)
#   peers-24    plain PyTorch, FSDP2 offload and DeepSpeed ZeRO-3 offload, gpt-4b capped at 24 GiB
#   plans-24    the searched plan against the hand-made ones, gpt-4b capped at 24 GiB
#   gpt-10b     elixir_ray alone on the 10.3B GPT capped at 70 GiB (the reference does not fit)
#
# Each stage writes OUT_DIR/STAGE/ (JSON, markdown, PNG where the tool makes one) and a log; each
# system's (or plan's) result is written as soon as it finishes, so a stage stopped midway keeps them.
# Python is `python3` unless PYTHON is set; the repository root must be importable.
#
# Environment:
#   STAGE_TIMEOUT_S  stop a stage (its whole process group) after this many seconds (default: no limit);
#                    set it below a remote command's own limit so that the stage's output is packed
#   PACK_INTO        after each stage, also pack OUT_DIR/STAGE into PACK_INTO/STAGE.tgz: one file per
#                    stage, for a transfer that brings back only a few files
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
stages="cuda-tests compute gpt-1.5b gpt-4b-40 gpt-4b-24 gpt-4b-16 peers-24 plans-24 gpt-10b"

stage_command() {
    local stage="$1" dir="$2"
    case "$stage" in
        cuda-tests) "$PY" -m pytest -q -s -p no:cacheprovider tests/test_engine_cuda.py ;;
        compute) "$PY" jobs/bench_compute.py --out "$dir/compute.json" ;;
        gpt-1.5b) "$PY" jobs/bench.py --shape gpt-1.5b --cap 24GiB --systems reference elixir_ray --out "$dir" ;;
        gpt-4b-40) "$PY" jobs/bench.py --shape gpt-4b --cap 40GiB --systems reference elixir_ray --out "$dir" ;;
        gpt-4b-24) "$PY" jobs/bench.py --shape gpt-4b --cap 24GiB --systems reference elixir_ray --out "$dir" ;;
        gpt-4b-16) "$PY" jobs/bench.py --shape gpt-4b --cap 16GiB --systems reference elixir_ray --out "$dir" ;;
        peers-24) "$PY" jobs/bench.py --shape gpt-4b --cap 24GiB --systems reference fsdp2_offload deepspeed_z3_offload \
                      --out "$dir" ;;
        plans-24) "$PY" jobs/bench_plans.py --shape gpt-4b --cap 24GiB --steps 2 --out "$dir/plans.json" ;;
        gpt-10b) "$PY" jobs/bench.py --shape gpt-10b --cap 70GiB --systems elixir_ray --steps 4 --out "$dir" ;;
    esac
}

if [ "${1:-}" = "--one-stage" ]; then  # how run_stage runs one stage under STAGE_TIMEOUT_S
    stage_command "$2" "$3"
    exit $?
fi

if [ $# -lt 2 ]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
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
    mkdir -p "$dir"
    echo "== $stage ($(date -u +%H:%M:%S))"
    if [ "${STAGE_TIMEOUT_S:-0}" -gt 0 ]; then
        # timeout signals the stage's whole process group: the measured processes it started go too
        timeout --kill-after=20 "$STAGE_TIMEOUT_S" bash "$0" --one-stage "$stage" "$dir" 2>&1 | tee "$dir/log.txt"
    else
        stage_command "$stage" "$dir" 2>&1 | tee "$dir/log.txt"
    fi
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 124 ]; then
        echo "== $stage stopped after STAGE_TIMEOUT_S=$STAGE_TIMEOUT_S s" | tee -a "$dir/log.txt"
    fi
    echo "== $stage exited $rc ($(date -u +%H:%M:%S))"
    if [ -n "${PACK_INTO:-}" ]; then
        mkdir -p "$PACK_INTO" && tar czf "$PACK_INTO/$stage.tgz" -C "$out" "$stage"
    fi
    return "$rc"
}

status=0
for stage in "$@"; do
    run_stage "$stage" || status=1
done
exit "$status"
