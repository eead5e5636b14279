#!/usr/bin/env bash
# Reproduce experiment 'batch-size' (E; conf/experiment/batch-size.yaml, EXPERIMENTS.md):
# SRCNN on DIV2K-style patches, batch 8 ... 128, PNG files vs LMDB (lz4) vs raw shards.
#   scripts/reproduce/batch-size.sh tiny|small|full      (full: DATA=<DIV2K root>, a GPU box)
source "$(dirname "$0")/_common.sh"
parse_size "${1:-}"
case "$SIZE" in
    # tiny: two batch sizes only (the sweep's command-line value replaces the yaml's)
    tiny) overrides="trainer.batch_size=8,64 dataset.prepare.train_count=16 dataset.prepare.val_count=4 dataset.repeat=4 trainer.epochs=1" ;;
    small) overrides="dataset.prepare.train_count=64 dataset.prepare.val_count=8 dataset.repeat=8" ;;
    full)
        : "${DATA:?full size needs DATA=<DIV2K root with DIV2K_train_HR/, DIV2K_train_LR_bicubic/X2/, DIV2K_valid_*>}"
        overrides="dataset.root=$DATA dataset.prepare=null dataset.repeat=16 loader.num_workers=16" ;;
esac
# shellcheck disable=SC2086  # the size's overrides are separate words
run_experiment batch-size "variant=png_files trainer.batch_size=8" $overrides
