#!/usr/bin/env bash
# Reproduce experiment 'loaders' (A1; conf/experiment/loaders.yaml, EXPERIMENTS.md) on the COCO
# detection workload:
#   scripts/reproduce/loaders.sh tiny|small|full      (full: DATA=<COCO 2017 root>, a GPU box)
source "$(dirname "$0")/_common.sh"
parse_size "${1:-}"
case "$SIZE" in
    tiny) overrides="dataset.prepare.train_images=48 dataset.prepare.val_images=8 trainer.epochs=1 trainer.batch_size=8" ;;
    small) overrides="dataset.prepare.train_images=96 dataset.prepare.val_images=16 trainer.batch_size=8" ;;
    full)
        : "${DATA:?full size needs DATA=<COCO 2017 root with train2017/, val2017/, annotations/>}"
        overrides="dataset=coco2017 dataset.root=$DATA dataset.layout.subset=5000 model=fasterrcnn_resnet50_fpn trainer.batch_size=8" ;;
esac
# shellcheck disable=SC2086  # the size's overrides are separate words
run_experiment loaders "loader=baseline" $overrides
