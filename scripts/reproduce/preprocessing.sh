#!/usr/bin/env bash
# Reproduce experiment 'preprocessing' (see conf/experiment/preprocessing.yaml and EXPERIMENTS.md):
#   scripts/reproduce/preprocessing.sh tiny|small|full      (full: DATA=<ImageFolder root>)
source "$(dirname "$0")/_common.sh"
parse_size "${1:-}"
overrides=$(synthetic_size "$SIZE")  # an assignment: a missing DATA stops here
# The pre-resized packs' longer side: 2x the training crop at every size (64 px crops:
# conf/experiment/preprocessing.yaml's 128; ImageNet's 224 px crops and 256 px evaluation
# resize: 448), so the variant reads less data, not lower-resolution images.
if [[ $SIZE == full ]]; then overrides+=" preresize_side=448"; fi
# shellcheck disable=SC2086  # the size's overrides are separate words
run_experiment preprocessing "variant=textbook_float" $overrides
