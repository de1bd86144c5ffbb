#!/usr/bin/env bash
# A GPU node's checks and docs/performance.md's GPU rows; each part one run of under 8 minutes.
#
#   bash bench/gpu.sh [OUTDIR]                  # the DDP part (the default)
#   PARTS=sharded bash bench/gpu.sh [OUTDIR]    # the sharded (FSDP2) part
#   PARTS=check bash bench/gpu.sh [OUTDIR]      # both parts' tests at once, then the recovery
#                                               # and sharded rows while BUDGET (570 s) lasts
#   PARTS=nccl bash bench/gpu.sh [OUTDIR]       # the checks of several NCCL ranks (sharing the
#                                               # GPU where there is one), the DDP tests, then the
#                                               # recovery and steady rows while BUDGET lasts
#   PARTS=inplace bash bench/gpu.sh [OUTDIR]    # in place on NCCL: what a survivor sees, and
#                                               # its re-forming against a fresh rank's start
#
# ddp:     1. The tests that need a GPU: NCCL resume bit-identical, CUDA RNG, overlapped
#             refreshes, SIGKILL mid-refresh, and the default job (README's first command) on NCCL.
#          2. bench/recovery.py --device cuda --nproc 1 (elasticd vs torchrun, kill -9 -> next
#             step) and bench/steady.py --nproc 1 --workloads gpu (step time, alternating).
# sharded: 1. tests/unit/checkpoint/test_sharded_gpu.py: FSDP2 on NCCL, CUDA shards refreshed overlapped,
#             a crash resumed bit-exact onto the GPU (two GPUs: a node lost, from the replica).
#          2. bench/sharded.py --device cuda at 2 ranks where two GPUs allow (NCCL wants a GPU
#             per rank), else 1: 100 MB, then 1 GB if time allows: stall per disk save and per
#             in-memory refresh against dcp.save/async_save, kill -9 resume against torchrun.
# nccl:    1. At once, the tests of several NCCL ranks (sharing the GPU where there is one:
#             tests/scripts/one_gpu.py gives each a host id of its own): the referee's claim on
#             NCCL and the GPU, the hang verdicts on NCCL (a desync, a rank that never arrived;
#             torch's NCCL Flight Recorder and our hook), the FSDP2 GPU tests (two ranks where
#             two GPUs are); and the DDP part's tests. Their files: OUTDIR/nccl-tests.tgz.
#          2. The DDP part's recovery and steady rows while BUDGET lasts.
# inplace: bench/inplace_nccl.py, 2 NCCL ranks (sharing the GPU where there is one), rank 1
#          SIGKILLed: how the survivor learns (an error, or stuck; with a thread of its own that
#          aborts the group at the generation's announcement), whether it re-forms in place with a
#          fresh rank 1 (dist._reconfigure) and sums right, each under TORCH_NCCL_ASYNC_ERROR_
#          HANDLING 3 and 2; the fresh rank's import / CUDA context / init / form, what the
#          survivor keeps.
# Wheels in .whl/ (structlog, tenacity, prometheus-client, pytest-timeout: what a bare image
# lacks) are installed to /tmp/site first.
set -uo pipefail
out=${1:-${OUT:-/tmp/elasticd-gpu}}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
step() { echo "== $(date -u +%T) $*"; }

step environment
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__,
  "nccl", ".".join(map(str, torch.cuda.nccl.version())), torch.cuda.get_device_name(),
  "gpus", torch.cuda.device_count())'
nproc

gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
world=$((gpus >= 2 ? 2 : 1))
left() { echo $((${BUDGET:-570} - SECONDS)); }  # seconds left of this run's device time

reap() {  # a bench cut short by its timeout leaves its launchers (own sessions) and their workers
  pkill -9 -f 'm elasticd run|sharded_train.py|step_logger.py|inplace_nccl.py|torch.distributed.run' || true
}
sharded_tests() {
  step "sharded: tests that need a GPU ($gpus GPUs)"
  timeout 200 python3 -m pytest -q -rs -p no:cacheprovider --basetemp=/tmp/gpu-sharded-tests \
    tests/unit/checkpoint/test_sharded_gpu.py >"$out/sharded-tests.txt" 2>&1
  tail -8 "$out/sharded-tests.txt"
}
sharded_bench() {  # MB TIMEOUT
  step "sharded bench, $world ranks, $1 MB, CUDA/NCCL"
  timeout "$2" python3 bench/sharded.py --device cuda --worlds "$world" --sizes "$1" --json \
    2>&1 | tee "$out/sharded-$1.txt" | tail -12
  reap
}
ddp_tests() {
  step "tests that need a GPU"
  timeout 240 python3 -m pytest -q -rs -p no:cacheprovider --basetemp=/tmp/gpu-ddp-tests \
    -k "cuda or overlapped or gpu or default_job" tests/unit/checkpoint/test_memory.py \
    tests/unit/checkpoint/test_checkpoint.py tests/e2e/test_resume.py tests/e2e/test_torchrun_flags_run.py >"$out/tests.txt" 2>&1
  tail -15 "$out/tests.txt"
}
recovery() {
  step "recovery, kill -9 -> next step"
  timeout "${1:-230}" python3 bench/recovery.py --device cuda --nproc 1 --warmup 3 \
    --trials ${TRIALS:-6} --launchers elasticd,torchrun 2>&1 | tee "$out/recovery.txt" | tail -25
  reap
}
steady() {
  step "steady state, gpu workload"
  timeout "${1:-150}" python3 bench/steady.py --nproc 1 --workloads gpu --rounds ${ROUNDS:-2} \
    --variants elasticd 2>&1 | tee "$out/steady.txt" | tail -15
}

nccl_tests() {  # all at once: they time nothing (a broken NCCL costs the slowest one's timeout)
  step "NCCL at 2-3 ranks ($gpus GPUs): the referee's claim, hang verdicts; FSDP2; the DDP tests"
  pytest_to() {  # OUTFILE BASETEMP PYTEST-ARGS...
    local to=$1 base=$2
    shift 2
    timeout 200 python3 -m pytest -q -rs -p no:cacheprovider --basetemp="/tmp/$base" "$@" \
      >"$out/$to" 2>&1
  }
  pytest_to referee.txt gpu-referee tests/unit/daemon/test_referee.py -k nccl &
  pytest_to hang-nccl.txt gpu-nccl tests/e2e/test_hang.py -k nccl &
  pytest_to sharded-tests.txt gpu-sharded-tests tests/unit/checkpoint/test_sharded_gpu.py &
  ddp_tests
  wait
  tail -n 6 "$out/referee.txt" "$out/hang-nccl.txt" "$out/sharded-tests.txt"
  tar czf "$out/nccl-tests.tgz" -C /tmp gpu-referee gpu-nccl 2>/dev/null  # the logs (not sharded: 36 MB)
}

case ${PARTS:-ddp} in
  inplace)
    step "in place on NCCL ($gpus GPUs)"
    timeout $(($(left) - 60)) python3 bench/inplace_nccl.py --trials 2 2>&1 |
      tee "$out/inplace-nccl.txt" | tail -12
    reap
    ;;
  nccl)
    python3 -c 'import torch.distributed as d; print("in place:", hasattr(d, "_reconfigure"))'
    nccl_tests
    if (($(left) > 140)); then recovery $(($(left) > 300 ? 200 : $(left) - 100)); fi
    if (($(left) > 70)); then ROUNDS=1 steady $(($(left) - 5)); else step "steady skipped"; fi
    ;;
  check)  # both parts' tests at once (they do not time anything), then the rows as time allows
    sharded_tests &
    ddp_tests
    wait
    sharded_bench 100 130
    if (($(left) > 150)); then recovery $(($(left) > 230 ? 200 : $(left) - 20)); fi
    if (($(left) > 150)); then sharded_bench 1000 $(($(left) - 15)); else step "1 GB skipped"; fi
    ;;
  sharded)
    sharded_tests
    sharded_bench 100 130
    if ((SECONDS <= ${SHARDED_BEFORE:-260})); then sharded_bench 1000 200; else step "1 GB skipped"; fi
    ;;
  *)
    ddp_tests
    recovery
    if ((SECONDS <= ${STEADY_BEFORE:-420})); then steady; else step "steady skipped: ${SECONDS}s gone"; fi
    ;;
esac
step done
