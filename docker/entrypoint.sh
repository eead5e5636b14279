#!/bin/sh
# The image's entrypoint. Two jobs, then it runs the command it was given:
#
# 1. Not as root. Started as root (docker's default), it re-executes itself as the owner of
#    the outputs folder (FASTLOAD_OUTPUTS, default /app/outputs): with `-v "$PWD/outputs:
#    /app/outputs"` that is you, so the runs land there owned by you; when nothing user-owned
#    is mounted there, as the image's `fastload` user (uid 1000). Started with --user, it
#    keeps that user. FASTLOAD_RUN_AS_ROOT=1 keeps root (e.g. to install packages).
# 2. One process per visible GPU. `python train.py ARGS` becomes `torchrun --standalone
#    --nproc_per_node=<GPUs> train.py ARGS` when more than one GPU is visible (and it is not
#    already under torchrun). FASTLOAD_NPROC=<n> sets the count (1: a single process).
set -eu

outputs=${FASTLOAD_OUTPUTS:-/app/outputs}
if [ "$(id -u)" = 0 ] && [ "${FASTLOAD_RUN_AS_ROOT:-0}" != 1 ]; then
    uid=$(stat -c %u "$outputs" 2>/dev/null || echo 0)
    gid=$(stat -c %g "$outputs" 2>/dev/null || echo 0)
    if [ "$uid" = 0 ]; then
        uid=${FASTLOAD_UID:-1000}
        gid=${FASTLOAD_GID:-1000}
    fi
    # HOME must be writable by that user (W&B and torch write caches under it).
    if [ "$uid" = "${FASTLOAD_UID:-1000}" ] && [ -d /home/fastload ]; then
        export HOME=/home/fastload
    else
        export HOME=/tmp/fastload-home
    fi
    exec setpriv --reuid="$uid" --regid="$gid" --clear-groups -- "$0" "$@"
fi
# --user with a uid the image does not know gets HOME=/, which nobody can write.
if ! { mkdir -p "${HOME:-/}" && [ -w "${HOME:-/}" ]; } 2>/dev/null; then
    export HOME=/tmp/fastload-home
    mkdir -p "$HOME"
fi

visible_gpus() {
    python - <<'PY' 2>/dev/null || echo 0
import os
visible = os.environ.get("CUDA_VISIBLE_DEVICES")
if visible is not None:  # set by the user: exactly those
    print(len([d for d in visible.split(",") if d.strip() not in ("", "-1")]))
else:
    import pynvml  # nvidia-ml-py: cheap, no CUDA context (torch would take seconds)

    pynvml.nvmlInit()
    print(pynvml.nvmlDeviceGetCount())
PY
}

if [ "$#" -ge 2 ] && [ "$1" = python ] && [ "$2" = train.py ] && [ -z "${LOCAL_RANK:-}" ]; then
    n=${FASTLOAD_NPROC:-$(visible_gpus)}
    case "$n" in '' | *[!0-9]*)
        echo "FASTLOAD_NPROC=$n: use a whole number of processes (the GPUs to train on)." >&2
        exit 2 ;;
    esac
    if [ "$n" -gt 1 ]; then
        shift 2
        echo "entrypoint: $n GPUs visible, starting one process per GPU (FASTLOAD_NPROC=1 for one)" >&2
        exec torchrun --standalone --nproc_per_node="$n" train.py "$@"
    fi
fi
exec "$@"
