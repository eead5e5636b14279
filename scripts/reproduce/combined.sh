#!/usr/bin/env bash
# Reproduce experiment 'combined' (see conf/experiment/combined.yaml and EXPERIMENTS.md):
#   scripts/reproduce/combined.sh tiny|small|full      (full: DATA=<ImageFolder root>)
source "$(dirname "$0")/_common.sh"
parse_size "${1:-}"
overrides=$(synthetic_size "$SIZE")  # an assignment: a missing DATA stops here
# shellcheck disable=SC2086  # the size's overrides are separate words
run_experiment combined "variant=published_baseline" $overrides
