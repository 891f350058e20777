#!/usr/bin/env bash
# One device call's worth of GPU checks, prepared here and run there in a single command:
#
#   bash jobs/gpu_session.sh STAGE [STAGE ...]      (on the GPU machine, from the repository root)
#
# It prints what the machine has (GPU, driver, torch), unpacks the offline Ray wheel-site (and the
# DeepSpeed wheels, where present) carried in .device/ into /tmp/site, then runs the named
# stages of jobs/bench_matrix.sh with each stage packed into $OUT/STAGE.tgz as it finishes, so a
# call stopped by its time limit still brings back every stage it completed.
#
# Before the call, on the development machine (once per checkout):
#   echo /.device/ >> .git/info/exclude && mkdir -p .device
#   cp ../shared/device/ray-2.60.0-cp312-site.tar.gz .device/
#   cp -r ../shared/device/deepspeed-wheels .device/      # for the stages that run DeepSpeed (peers-24, deepspeed-24, gpt-4b-24-all*)
# and name .device in the call's carry.
#
# Environment: OUT (where the packed stages go; default runs/gpu), STAGE_TIMEOUT_S (per stage;
# default 240), BENCH_DIR (the unpacked results; default /tmp/bench), PYTHON (default python3, the
# one that holds torch there).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
OUT="${OUT:-runs/gpu}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "gpu", torch.cuda.is_available())' 2>&1
    nproc; free -g | sed -n 2p
    # the host's cores: model, sockets, threads per core (hyperthreads share a core with the
    # training thread's Python), and the clock; what the host-bound steps depend on
    lscpu 2>/dev/null | grep -E "^(Model name|Socket|Core|Thread|CPU\(s\)|CPU max MHz|CPU MHz|NUMA node\(s\))" || true
} | tee "$OUT/machine.txt"
site=/tmp/site
mkdir -p "$site"
if ls .device/ray-*-site.tar.gz >/dev/null 2>&1; then
    tar -C "$site" -xzf .device/ray-*-site.tar.gz || { echo "unpacking Ray failed"; exit 1; }
elif ! "$PY" -c 'import ray' 2>/dev/null; then
    echo "no Ray here and none carried in .device/ (see the top of this script)"; exit 1
fi
if ls .device/deepspeed-wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .device/deepspeed-wheels/*.whl \
        || echo "installing DeepSpeed failed: the stages that run DeepSpeed will skip it"
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
STAGE_TIMEOUT_S="${STAGE_TIMEOUT_S:-240}" PACK_INTO="$OUT" PYTHON="$PY" \
    bash jobs/bench_matrix.sh "${BENCH_DIR:-/tmp/bench}" "$@"
