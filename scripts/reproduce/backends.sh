#!/usr/bin/env bash
# Reproduce experiment 'backends' (C; conf/experiment/backends.yaml, EXPERIMENTS.md):
#   scripts/reproduce/backends.sh tiny|small|full      (full: DATA=<ImageFolder root>)
# pil and turbo always; accimage when it imports in $PYTHON (conda-forge only); nvjpeg when
# CUDA is there. Pillow-SIMD replaces Pillow in its environment, so it runs from its own:
# PILLOW_SIMD_PYTHON=<that venv's python> (make one with scripts/install_pillow_simd.sh);
# its runs join the same report.
source "$(dirname "$0")/_common.sh"
parse_size "${1:-}"
overrides=$(synthetic_size "$SIZE")  # an assignment: a missing DATA stops here

backends=pil,turbo
if "$PYTHON" -c "import accimage" 2>/dev/null; then
    backends=$backends,accimage
else
    echo "accimage: not importable in $PYTHON (conda install -c conda-forge accimage); left out"
fi
if "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    backends=$backends,nvjpeg
else
    echo "nvjpeg: no CUDA device here; left out"
fi

# shellcheck disable=SC2086  # the size's overrides are separate words
run_experiment backends "backend=pil" "backend=$backends" $overrides

if [ -n "${PILLOW_SIMD_PYTHON:-}" ]; then
    # shellcheck disable=SC2086
    SWEEP_PYTHON=$PILLOW_SIMD_PYTHON sweep backends "$OUT/pillow-simd" backend=pillow-simd $overrides
    report backends "backend=pil" "$OUT" "$OUT"/pillow-simd/[0-9]*
else
    echo "pillow-simd: set PILLOW_SIMD_PYTHON=<a venv's python with Pillow-SIMD> to include it"
fi
