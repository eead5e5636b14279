#!/usr/bin/env bash
# Reproduce experiment 'storage' (see conf/experiment/storage.yaml and EXPERIMENTS.md):
#   scripts/reproduce/storage.sh tiny|small|full      (full: DATA=<ImageFolder root>)
source "$(dirname "$0")/_common.sh"
parse_size "${1:-}"
overrides=$(synthetic_size "$SIZE")  # an assignment: a missing DATA stops here
# shellcheck disable=SC2086  # the size's overrides are separate words
run_experiment storage "storage=slow_disk" $overrides
