# Sourced by scripts/reproduce/<name>.sh. Runs one experiment as a Hydra multirun over
# conf/experiment/<name>.yaml (its variants in hydra.sweeper.params), repeated for a median
# and spread, into outputs/reproduce/<name>/<size>-<time>/, then `python -m fastload.report`
# on the job folders. Sizes:
#   tiny   a smoke run of a minute or two on 2 CPU cores (a few images, 1 epoch, 1 repeat)
#   small  a few minutes on 2 CPU cores (2-7 min here; the built-in synthetic data, 3 repeats)
#   full   the published scale, for a GPU box: DATA=<dataset root> (see each script)
# Environment: PYTHON (default python), FASTLOAD_REPRODUCE_DIR (default outputs/reproduce),
# REPEATS (override the size's repeat count).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# `python -m fastload.report` from a checkout that was not pip-installed (train.py finds the
# package beside it; -m needs it on the path)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python}

parse_size() {  # SIZE -> sets SIZE and REPEATS, or prints the usage and exits 2
    SIZE=${1:-}
    case "$SIZE" in
        tiny) REPEATS=${REPEATS:-1} ;;
        small) REPEATS=${REPEATS:-3} ;;
        full) REPEATS=${REPEATS:-3} ;;
        *)
            echo "usage: $0 tiny|small|full   (tiny: 1-2 min smoke run; small: a few minutes on 2 CPU cores; full: the published scale on a GPU box)" >&2
            exit 2
            ;;
    esac
}

# The built-in synthetic ImageNet-style set at each size (classification experiments).
synthetic_size() {  # SIZE -> overrides
    case "$1" in
        tiny) echo "dataset.num_classes=4 dataset.prepare.train_per_class=24 dataset.prepare.val_per_class=4 trainer.epochs=1 trainer.batch_size=16" ;;
        small) echo "dataset.num_classes=10 dataset.prepare.train_per_class=120 dataset.prepare.val_per_class=20" ;;
        full)
            : "${DATA:?full size needs DATA=<an ImageFolder root with train/ and val/> (e.g. ImageNet)}"
            echo "dataset=imagenet dataset.root=$DATA model=resnet50 trainer.batch_size=256 trainer.max_steps_per_epoch=${FULL_STEPS:-400}" ;;
    esac
}

# sweep NAME SWEEP_DIR [OVERRIDE...]: the multirun of conf/experiment/NAME.yaml with the
# repeats, every run in one W&B group ($GROUP) with the experiment's tags.
sweep() {
    local name=$1 dir=$2
    shift 2
    "${SWEEP_PYTHON:-$PYTHON}" "$REPO/train.py" -m "experiment=$name" \
        "+repeat=$(seq -s, 0 $((REPEATS - 1)))" "hydra.sweep.dir=$dir" "logger.group=$GROUP" \
        "logger.tags=[reproduce,$name,$SIZE]" trainer.progress=false trainer.checkpoint_every=0 "$@"
}

# run_experiment NAME BASELINE [OVERRIDE...]: the multirun into $OUT, then the report.
run_experiment() {
    local name=$1 baseline=$2
    shift 2
    GROUP=$name-$SIZE-$(date +%Y-%m-%d_%H-%M-%S)
    OUT=${FASTLOAD_REPRODUCE_DIR:-$REPO/outputs/reproduce}/$name/${GROUP#"$name"-}
    echo "== $name ($SIZE): $REPEATS repeat(s) per variant -> $OUT"
    sweep "$name" "$OUT" "$@"
    report "$name" "$baseline" "$OUT"
}

report() {  # NAME BASELINE OUT [EXTRA RUN DIRS...]
    local name=$1 baseline=$2 out=$3
    shift 3
    "$PYTHON" -m fastload.report "$out"/[0-9]* "$@" --out "$out/report" \
        --baseline "$baseline" --title "$name ($SIZE)"
    echo "$out/report"
}
