# Settings shared by the Slurm launch scripts (pretrain.sbatch, and the scaling-law sweep).
# Source it from a batch script, inside the allocation. It reads the job's SLURM_* variables and sets
#   PYTHON NNODES GPUS_PER_NODE NPROC_PER_NODE HEAD_NODE RDZV_PORT RDZV_ID
# and exports the library settings below. Anything already in the environment wins, and sbatch
# exports the submitting shell's environment, so `GPUS_PER_NODE=4 sbatch ...` overrides a value.
# Outside Slurm (a local dry run) it falls back to one node: this machine.
# shellcheck shell=bash disable=SC2034  # the variables are used by the scripts that source this

# --- Program -----------------------------------------------------------------------------------
PYTHON=${PYTHON:-python}                     # interpreter with `pretrain` installed (e.g. a venv's)

# --- Process layout ----------------------------------------------------------------------------
NNODES=${SLURM_NNODES:-1}
# GPUs per node: what Slurm allocated (--gpus-per-node), else what the node has, else 0 (CPU).
if [[ -z ${GPUS_PER_NODE:-} ]]; then
    if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
        GPUS_PER_NODE=$SLURM_GPUS_ON_NODE
    elif command -v nvidia-smi >/dev/null 2>&1; then
        GPUS_PER_NODE=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)
    else
        GPUS_PER_NODE=0
    fi
fi
# One training process per GPU; a CPU-only node runs one process (gloo).
NPROC_PER_NODE=$(( GPUS_PER_NODE > 0 ? GPUS_PER_NODE : 1 ))

# --- Rendezvous --------------------------------------------------------------------------------
# The first node of the allocation hosts torchrun's c10d store. (sed, not head -n1: head exits early
# and, with a long node list under `set -o pipefail`, scontrol's SIGPIPE would abort the script.)
if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
    HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
else
    HEAD_NODE=$(hostname)
fi
RDZV_ID=${SLURM_JOB_ID:-local}
# A port per job and start: two jobs sharing a node must never join each other's store (a fixed
# 29500 does), and a restart inside the allocation gets a fresh store on the next port. So each job
# owns a block of RDZV_PORTS_PER_JOB ports (its first start, then up to 15 restarts): "job id +
# restart" would be the next job's own port, and a store that cannot bind its port becomes a client
# of the store already there, dying with that other job. 15000-29999 stays below Linux's ephemeral
# range (32768+), where a busy node's own connections live. (pretrain/parallel/distributed.py uses the same
# rule for a bare srun.)
RDZV_PORTS_PER_JOB=16
RDZV_PORT=${RDZV_PORT:-$(( 15000 + ${SLURM_JOB_ID:-0} % (15000 / RDZV_PORTS_PER_JOB) * RDZV_PORTS_PER_JOB ))}
rdzv_port() {  # the rendezvous port of restart $1 (0: the first start)
    echo $(( RDZV_PORT + $1 ))
}

# --- Slurm -------------------------------------------------------------------------------------
# srun does not inherit sbatch's --cpus-per-task since Slurm 22.05; without this a step gets one
# CPU per task, and with CPU binding all of a node's trainers and data workers share one core.
if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
    export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
fi
# After the checkpoint for SIGUSR1 (the time-limit warning of --signal=USR1@120, or
# `scancel --signal=USR1`), rank 0 runs `scontrol requeue $SLURM_JOB_ID` (an array task's
# ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}): the job goes back to the queue and the rerun resumes. 0 = save and stop. (SIGTERM - scancel, the limit itself - never requeues.)
export PRETRAIN_REQUEUE=${PRETRAIN_REQUEUE:-1}

# --- Libraries ---------------------------------------------------------------------------------
# Log lines reach the job's output file as they are printed, not when a buffer fills.
export PYTHONUNBUFFERED=1
# A crash prints every thread's Python stack (and `kill -ABRT` on a hung rank shows where it hangs).
export PYTHONFAULTHANDLER=1
# Intra-op threads per training process: the task's CPUs shared among the node's processes.
# (torchrun sets 1 when it starts several processes per node, which starves CPU-side work.)
cpus_per_proc=$(( ${SLURM_CPUS_PER_TASK:-1} / NPROC_PER_NODE ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cpus_per_proc > 0 ? cpus_per_proc : 1 ))}
# NCCL prints warnings only; set INFO (and NCCL_DEBUG_SUBSYS=INIT,NET) to see which network
# it chose: the first thing to look at when a multi-node job hangs at start or is slow.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# A collective that times out (distributed.timeout_s): torch's NCCL watchdog aborts the communicator
# and ends the process instead of leaving it stuck (1), after dumping its flight recorder - each
# rank's last 2000 collectives - to TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank> (default /tmp/nccl_trace_rank_,
# on each node). Our own watchdog (docs/reliability.md) normally fires first and names the rank.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
# Site-specific, usually set by the cluster's modules; uncomment and adapt if NCCL picks the wrong
# network (e.g. an Ethernet management interface instead of InfiniBand):
# export NCCL_SOCKET_IFNAME=ib0       # interface for NCCL's bootstrap and socket transport
# export NCCL_IB_HCA=mlx5             # InfiniBand adapters to use
# export GLOO_SOCKET_IFNAME=ib0       # the same for gloo (else derived below)

# gloo carries the trainer's host-side collectives (every step and every save, all of a CPU run).
# Left unset, it binds to the address the node's name resolves to, often 127.0.1.1 or a management
# NIC, and a multi-node job fails or hangs. So: NCCL_SOCKET_IFNAME when it is one of this node's
# interfaces, else the interface that routes to another node of the job. (This runs on the first
# node, so not the route to HEAD_NODE, which is lo here; lo only for a loopback address: one node,
# or the test cluster.) Unset if `ip` or `getent` is missing. Every node gets the name found here.
if [[ -z ${GLOO_SOCKET_IFNAME:-} ]]; then
    gloo_if=${NCCL_SOCKET_IFNAME:-}
    gloo_if=${gloo_if#=}  # NCCL's exact-name form; a prefix ("ib") or a list ("^docker,lo") is no name
    if [[ -z $gloo_if || ! -e /sys/class/net/$gloo_if ]]; then
        peer=$HEAD_NODE
        if (( NNODES > 1 )) && [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
            peer=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 2p) || true
        fi
        peer_addr=$(getent hosts "$peer" 2>/dev/null | awk '{print $1; exit}') || true
        gloo_if=$(ip route get "$peer_addr" 2>/dev/null |
                  awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}') || true
        if [[ $gloo_if == lo && $peer_addr != 127.* && $peer_addr != ::1 ]]; then
            gloo_if=""
        fi
    fi
    if [[ -n $gloo_if ]]; then
        export GLOO_SOCKET_IFNAME=$gloo_if
    fi
fi
