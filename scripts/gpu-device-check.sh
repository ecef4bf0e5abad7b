#!/usr/bin/env bash
# GPU device check: the one script a session runs on a machine with real NVIDIA GPUs (an H200 node),
# in at most ~5 minutes. CI never runs it. It records, under $OUT:
#   env.txt, nvidia-smi-*.txt   what the driver itself says (to compare with muster's report)
#   gpu-check.json / .txt       `muster gpu-check --json --expect-gpus N` (NVML checks + CUDA smoke)
#   nvml-snapshot.json          the raw NVML snapshot (commit as a fixture recorded from hardware)
#   cuda-smoke.json             the CUDA smoke child's own report (per GPU, per peer pair)
#   nccl-allreduce.txt          a 1-node all-reduce over every GPU, NCCL, through the muster store
#   warm-restart.txt / .err     a killed rank restarted in its warm standby (issue #41): each rank
#                               of the next attempt reports its GPU, CUDA_VISIBLE_DEVICES and
#                               whether CUDA was initialised before the script ran; NCCL again
#   summary.txt / summary.json  one line / entry per step with its exit status
#
# Usage (from the repo root, after `cargo build --release -p muster`):
#   OUT=/tmp/gpu-check scripts/gpu-device-check.sh
# Environment: MUSTER_BIN (default target/release/muster), MUSTER_TORCH_PYTHON (a python with a
# CUDA build of torch; default: the first of python3/python that has one), BUDGET_S (default 290).
# Every step has its own timeout and the whole run stops starting steps when the budget is spent.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/muster-gpu-device-check}
mkdir -p "$OUT"
MUSTER=${MUSTER_BIN:-target/release/muster}
BUDGET_S=${BUDGET_S:-290}
START=$(date +%s)
: > "$OUT/summary.txt"
STEPS_JSON=()

log() { echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"; }

# run_step NAME TIMEOUT_S OUTFILE CMD...: runs CMD with stdout to OUTFILE, stderr to NAME.err.
run_step() {
    local name=$1 limit=$2 outfile=$3
    shift 3
    local left=$((BUDGET_S - ($(date +%s) - START)))
    if ((left < 10)); then
        log "$name: SKIPPED (time budget spent)"
        STEPS_JSON+=("{\"step\":\"$name\",\"rc\":null,\"skipped\":true}")
        return 0
    fi
    ((limit > left - 5)) && limit=$((left - 5))
    local t0=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$OUT/$outfile" 2> "$OUT/$name.err"
    local rc=$?
    local took=$(($(date +%s) - t0))
    log "$name: rc=$rc in ${took}s (limit ${limit}s) -> $outfile"
    STEPS_JSON+=("{\"step\":\"$name\",\"rc\":$rc,\"seconds\":$took}")
    return 0
}

log "muster GPU device check, output in $OUT"
if [[ ! -x $MUSTER ]]; then
    log "muster binary not found at $MUSTER (build with: cargo build --release -p muster)"
    exit 1
fi

# 1. What the driver says, for comparison with muster's report and matrix.
{
    echo "host: $(hostname)"
    uname -a
    echo "muster: $("$MUSTER" gpu-check --help >/dev/null 2>&1 && echo ok) ($MUSTER)"
    ls -l /dev/nvidia* 2>&1 | head -20
    ls /proc/driver/nvidia/gpus 2>&1
    for f in /proc/driver/nvidia/gpus/*/information; do echo "== $f"; cat "$f"; done 2>/dev/null
    env | grep -E '^(NVIDIA|CUDA|NCCL)_' | sort
} > "$OUT/env.txt" 2>&1
if command -v nvidia-smi >/dev/null; then
    run_step nvidia-smi-L 15 nvidia-smi-L.txt nvidia-smi -L
    run_step nvidia-smi-topo 20 nvidia-smi-topo.txt nvidia-smi topo -m
    run_step nvidia-smi-nvlink 20 nvidia-smi-nvlink.txt nvidia-smi nvlink -s
    run_step nvidia-smi-q 30 nvidia-smi-q.txt nvidia-smi -q
    NGPU=$(grep -c '^GPU ' "$OUT/nvidia-smi-L.txt" || true)
else
    log "nvidia-smi not in PATH; counting GPUs through muster"
    NGPU=""
fi
if [[ -z ${NGPU:-} || $NGPU == 0 ]]; then
    NGPU=$("$MUSTER" gpu-check --json --skip-cuda --fabric-wait 5 2>/dev/null |
        python3 -c 'import json,sys; print(len(json.load(sys.stdin)["gpus"]))' 2>/dev/null || echo 0)
fi
log "GPUs expected: $NGPU"

# 2. muster's own pre-flight, JSON (with the CUDA smoke test) and text (the matrix to compare
#    with nvidia-smi topo -m), and the raw snapshot to commit as a recorded fixture.
run_step gpu-check-json 100 gpu-check.json \
    "$MUSTER" gpu-check --json --expect-gpus "$NGPU" --fabric-wait 30 --cuda-timeout 60
run_step gpu-check-text 40 gpu-check.txt \
    "$MUSTER" gpu-check --expect-gpus "$NGPU" --fabric-wait 10 --skip-cuda
run_step nvml-snapshot 30 nvml-snapshot.json \
    "$MUSTER" gpu-check --dump-snapshot --fabric-wait 10

# 3. The CUDA smoke child on its own, with peer copies between neighbouring GPUs.
PEERS=""
for ((i = 0; i + 1 < NGPU; i++)); do PEERS+="${PEERS:+,}$i-$((i + 1))"; done
run_step cuda-smoke 60 cuda-smoke.json \
    env CUDA_DEVICE_ORDER=PCI_BUS_ID "$MUSTER" gpu-check --cuda-smoke-child ${PEERS:+--peers "$PEERS"}

# 4. NCCL all-reduce on every local GPU, one process per GPU, through the muster store.
PY=${MUSTER_TORCH_PYTHON:-}
if [[ -z $PY ]]; then
    for cand in python3 python; do
        if command -v "$cand" >/dev/null &&
            timeout 60 "$cand" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
            PY=$cand
            break
        fi
    done
fi
cat > "$OUT/allreduce.py" <<'EOF'
"""One rank of a 1-node NCCL all-reduce. Rendezvous through MUSTER_STORE_HOST/PORT when set
(a `muster store`), else through the launcher's env:// store."""
import json, os, time
import torch
import torch.distributed as dist

rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"])
local = int(os.environ.get("LOCAL_RANK", rank))
torch.cuda.set_device(local)
host, port = os.environ.get("MUSTER_STORE_HOST"), os.environ.get("MUSTER_STORE_PORT")
if host and port:
    store = dist.TCPStore(host, int(port), world, is_master=False, timeout=__import__("datetime").timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
    via = f"muster store {host}:{port}"
else:
    dist.init_process_group("nccl")
    via = "launcher env:// store"
x = torch.full((1024,), float(rank + 1), device="cuda")
dist.all_reduce(x)
ok = bool(torch.all(x == world * (world + 1) / 2).item())
n = 256 << 20  # 1 GiB of float32
big = torch.ones(n, device="cuda")
for _ in range(3):
    dist.all_reduce(big)
torch.cuda.synchronize()
t0 = time.perf_counter()
iters = 10
for _ in range(iters):
    dist.all_reduce(big)
torch.cuda.synchronize()
dt = (time.perf_counter() - t0) / iters
busbw = (n * 4 / dt) * 2 * (world - 1) / world / 1e9
if rank == 0:
    print(json.dumps({"world": world, "correct": ok, "via": via, "bytes": n * 4,
                      "seconds_per_allreduce": dt, "busbw_GBps": busbw,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                      "torch": torch.__version__}))
dist.destroy_process_group()
if not ok:
    raise SystemExit(1)
EOF
if [[ -z $PY ]]; then
    log "nccl-allreduce: SKIPPED (no python with a CUDA build of torch; set MUSTER_TORCH_PYTHON)"
    STEPS_JSON+=('{"step":"nccl-allreduce","rc":null,"skipped":true}')
else
    # The launch form first: muster hosts the store and starts one rank per GPU.
    run_step nccl-allreduce-muster 90 nccl-allreduce.txt \
        env PYTHON_EXEC="$(command -v "$PY" || echo "$PY")" "$MUSTER" --nproc-per-node gpu "$OUT/allreduce.py"
    if ! grep -q '"correct": true' "$OUT/nccl-allreduce.txt" 2>/dev/null; then
        # Launch form unavailable or failed: torchrun starts the ranks, which rendezvous for NCCL
        # through a standalone `muster store`.
        log "muster launch did not produce a result; retrying with torchrun + muster store"
        "$MUSTER" store --host 127.0.0.1 --port 0 > "$OUT/store.out" 2> "$OUT/store.err" &
        STORE_PID=$!
        for _ in $(seq 50); do grep -q listening "$OUT/store.out" 2>/dev/null && break; sleep 0.1; done
        ADDR=$(head -1 "$OUT/store.out" | awk '{print $NF}')
        if [[ -n $ADDR ]]; then
            run_step nccl-allreduce-torchrun 90 nccl-allreduce.txt \
                env MUSTER_STORE_HOST="${ADDR%:*}" MUSTER_STORE_PORT="${ADDR##*:}" \
                "$PY" -m torch.distributed.run --standalone --nproc-per-node gpu "$OUT/allreduce.py"
        else
            log "muster store did not start ($(tail -1 "$OUT/store.err" 2>/dev/null)); torchrun's own store"
            run_step nccl-allreduce-torchrun 90 nccl-allreduce.txt \
                "$PY" -m torch.distributed.run --standalone --nproc-per-node gpu "$OUT/allreduce.py"
        fi
        kill "$STORE_PID" 2>/dev/null
        wait "$STORE_PID" 2>/dev/null
    fi
fi

# 5. Warm restarts on GPUs: standbys import torch (and CUDA's libraries) while attempt 0 trains,
#    without initialising CUDA; rank 1 is killed at attempt 0, and attempt 1's ranks start in their
#    standbys. Each reports what it sees at the script's first line (CUDA not initialised, the
#    same CUDA_VISIBLE_DEVICES and NCCL variables as a cold rank) and runs an NCCL all-reduce.
#    WARM_CHECK_BACKEND=gloo runs the same on CPUs (how this step is checked without a GPU).
cat > "$OUT/warm_restart.py" <<'EOF'
import json, os, signal, sys, time
started = {"cuda_initialized_at_start": "torch.cuda" in sys.modules and
           sys.modules["torch.cuda"].is_initialized()}
import torch
import torch.distributed as dist

backend = os.environ.get("WARM_CHECK_BACKEND", "nccl")
local = int(os.environ["LOCAL_RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
device = torch.device("cpu")
if backend == "nccl":
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.full((1024,), float(rank + 1), device=device)
dist.all_reduce(x)
report = dict(started, attempt=attempt, rank=rank, pid=os.getpid(),
              correct=bool(torch.all(x == world * (world + 1) / 2).item()),
              visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
              nccl={k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
              device=torch.cuda.get_device_name(local) if backend == "nccl" else "cpu")
print("WARM " + json.dumps(report), flush=True)
# Optimizer steps: the first one is what starts the standbys (muster's step reports).
model = torch.nn.Linear(16, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
deadline = time.time() + float(os.environ.get("WARM_CHECK_KILL_AFTER", "40"))
while attempt == 0:
    opt.zero_grad()
    model(torch.ones(4, 16, device=device)).sum().backward()
    opt.step()
    dist.all_reduce(x)
    if rank == 1 and time.time() > deadline:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
EOF
if [[ -z $PY && ${WARM_CHECK_BACKEND:-nccl} == nccl ]]; then
    log "warm-restart: SKIPPED (no python with a CUDA build of torch; set MUSTER_TORCH_PYTHON)"
    STEPS_JSON+=('{"step":"warm-restart","rc":null,"skipped":true}')
else
    WPY=${PY:-${MUSTER_TORCH_PYTHON:-python3}}
    WNPROC=gpu
    [[ ${WARM_CHECK_BACKEND:-nccl} == gloo ]] && WNPROC=2
    run_step warm-restart 120 warm-restart.txt \
        env PYTHON_EXEC="$(command -v "$WPY" || echo "$WPY")" "$MUSTER" --standalone \
        --nproc-per-node "$WNPROC" --max-restarts 1 --warm-restart on --metrics-addr none \
        "$OUT/warm_restart.py"
    WARM=$(grep -c 'warm start in its standby' "$OUT/warm-restart.err" 2>/dev/null)
    COLD=$(grep -c 'cold start' "$OUT/warm-restart.err" 2>/dev/null)
    log "warm-restart: ${WARM:-0} rank(s) started warm, ${COLD:-0} cold $(grep -o 'cold start: [^;]*' "$OUT/warm-restart.err" 2>/dev/null | head -1)"
fi

(
    IFS=,
    echo "{\"host\":\"$(hostname)\",\"gpus\":$NGPU,\"seconds\":$(($(date +%s) - START)),\"steps\":[${STEPS_JSON[*]}]}"
) > "$OUT/summary.json"
log "done in $(($(date +%s) - START))s"
