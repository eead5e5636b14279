#!/usr/bin/env bash
# Reproduce experiment 'workers' (see conf/experiment/workers.yaml and EXPERIMENTS.md):
#   scripts/reproduce/workers.sh tiny|small|full      (full: DATA=<ImageFolder root>)
source "$(dirname "$0")/_common.sh"
parse_size "${1:-}"
overrides=$(synthetic_size "$SIZE")  # an assignment: a missing DATA stops here
# The experiment's batch (32: conf/experiment/workers.yaml) at every size; the size's own
# (16 tiny, 256 full) would replace it.
overrides=$(sed -E 's/(^| )trainer\.batch_size=[0-9]+//' <<<"$overrides")
# shellcheck disable=SC2086  # the size's overrides are separate words
run_experiment workers "loader.num_workers=0" $overrides
