"""Every option of every config group composes, and what a run uses is what it prints."""

from __future__ import annotations

import pytest
from conftest import CONF, REPO, compose_config, resolve_all, run_train
from hydra.utils import instantiate
from omegaconf import OmegaConf

from fastload.tasks.base import build_task

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes(group, option, tmp_path):
    overrides = [f"{group}={option}", f"hydra.run.dir={tmp_path}"]
    cfg = compose_config(overrides, tmp_path)
    if OmegaConf.is_missing(cfg.dataset, "root"):  # a real dataset (imagenet, coco2017, ...)
        cfg = compose_config([*overrides, "dataset.root=/data/real"], tmp_path)
    resolved = resolve_all(cfg)
    assert cfg.hydra.runtime.choices[group] == option
    assert resolved["name"] and cfg.hydra.run.dir
    for key in ("storage", "backend", "loader", "model", "logger"):
        assert "_target_" in resolved[key], f"{key} has no _target_"


@pytest.mark.parametrize("dataset", options("dataset"))
def test_debug_fast_is_a_short_run_on_every_dataset(dataset, tmp_path):
    """debug=fast on a real dataset (ImageNet's 1.28M images) trained whole epochs in one
    process; each dataset has its debug_dataset shrink (a generated set's size, a subset, or
    capped steps)."""
    overrides = ["debug=fast", f"dataset={dataset}", f"hydra.run.dir={tmp_path}"]
    cfg = compose_config(overrides, tmp_path)
    assert cfg.hydra.runtime.choices.get("debug_dataset") == f"fast_{dataset}"
    prepare, layout = cfg.dataset.get("prepare"), cfg.dataset.get("layout") or {}
    assert prepare or layout.get("subset") or cfg.trainer.max_steps_per_epoch


def test_groups_named_in_design_exist():
    expected = {
        "dataset",
        "storage",
        "backend",
        "loader",
        "model",
        "optim",
        "logger",
        "trainer",
        "experiment",
        "debug",
    }
    assert expected <= set(GROUPS)


def test_model_and_optimizer_instantiate(tmp_path):
    cfg = compose_config([f"hydra.run.dir={tmp_path}", "dataset.num_classes=7"], tmp_path)
    model = build_task(cfg).build_model(cfg)
    assert model.fc.out_features == 7
    partial = instantiate(cfg.optim).optimizer
    opt = partial(model.parameters(), lr=0.1)
    assert opt.defaults["nesterov"] is True and opt.defaults["momentum"] == 0.9


def test_cfg_job_prints_the_resolved_groups():
    out = run_train(["--cfg", "job", "loader=baseline"], timeout=120)
    assert out.returncode == 0, out.stderr
    for key in ("dataset:", "storage:", "backend:", "loader:", "trainer:", "num_workers:"):
        assert key in out.stdout


def test_unknown_group_option_names_the_choices():
    out = run_train(["loader=nope"], timeout=120)
    assert out.returncode != 0
    assert "loader/nope" in out.stderr and "baseline" in out.stderr
    assert "Traceback" not in out.stderr


def test_readme_and_ci_use_the_same_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in readme and "make test" in ci


def test_debug_fasts_small_div2k_has_a_cache_folder_of_its_own(tmp_path):
    """debug=fast draws smaller DIV2K images than a run of the same counts: in one folder
    the two refused each other ("generated with different parameters")."""
    counts = ["dataset.prepare.train_count=32", "dataset.prepare.val_count=4"]
    fast = compose_config(["dataset=div2k", "debug=fast", f"hydra.run.dir={tmp_path}"], tmp_path)
    plain = compose_config(["dataset=div2k", *counts, f"hydra.run.dir={tmp_path}"], tmp_path)
    assert fast.dataset.root != plain.dataset.root
    assert fast.dataset.prepare.root == fast.dataset.root and fast.dataset.root.endswith("-l96-128")


def test_default_dataset_folder_is_named_by_generator_version(tmp_path):
    """A new synthetic renderer must land in a new cache folder, not trip over an old one."""
    from fastload.data.synthetic import GENERATOR_VERSION

    cfg = compose_config([f"hydra.run.dir={tmp_path}"], tmp_path)
    assert f"synthetic-imagenet-g{GENERATOR_VERSION}-" in cfg.dataset.root


@pytest.mark.parametrize(
    "dataset, model, optim",
    [("synthetic", "resnet18", "sgd"), ("coco", "fcos_tiny", "sgd"),
     ("coco2017", "fasterrcnn_resnet50_fpn", "sgd"), ("div2k", "srcnn", "adam")],
)  # fmt: skip
def test_each_workload_trains_its_own_model_unless_one_is_named(dataset, model, optim, tmp_path):
    """`python train.py dataset=coco` trains a detector instead of stopping to ask for one;
    a model or optimiser named on the command line (or by an experiment) still wins."""
    from hydra.core.hydra_config import HydraConfig

    base = [f"dataset={dataset}", "dataset.root=/data/real"]
    compose_config(base, tmp_path)
    choices = HydraConfig.get().runtime.choices
    assert (choices["model"], choices["optim"]) == (model, optim)
    cfg = compose_config([*base, "model=resnet50", "optim=sgd"], tmp_path)
    assert HydraConfig.get().runtime.choices["model"] == "resnet50"
    assert cfg.model.arch == "resnet50"


def test_experiments_use_the_cores_this_machine_has():
    for name in options("experiment"):
        cfg = compose_config([f"experiment={name}", "dataset.root=/data/real"])
        assert cfg.loader.num_workers == "auto", name


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["variant=preresized_shards", "storage=disk"],
            "storage.kind='jpeg': variant=preresized_shards sets it, written for storage=shards, "
            "but storage=disk takes no such option. Drop variant= (or storage=), or pick a "
            "storage that takes it (storage=lmdb, shards or webdataset).",
        ),
        (
            ["variant=lmdb_lz4", "storage=shards"],
            "storage.compression='lz4': variant=lmdb_lz4 sets it, written for storage=lmdb, but "
            "storage=shards takes no such option",
        ),
        (["variant=lmdb_lz4", "storage=tmpfs"], "storage.kind='raw': variant=lmdb_lz4 sets it"),
        (["+storage.shard_mb=64"], "storage.shard_mb=64: storage=disk takes no such option"),
    ],
)
def test_a_storage_key_the_storage_does_not_take_is_refused_by_name(overrides, message):
    """A variant= written for one storage kept its storage keys under another storage=, whose
    constructor then failed with a traceback (DiskStorage got an unexpected keyword 'kind')."""
    from fastload.engine import check_config
    from fastload.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        check_config(compose_config(overrides))
    assert message in err.value.user_message


def test_a_variants_storage_keys_under_another_storage_are_refused_before_packing(
    tiny_folder, tmp_path
):
    from conftest import tiny_overrides
    from test_train import assert_clean_failure

    packs = tmp_path / "packs"
    args = ["variant=lmdb_lz4", "storage=shards", f"storage.path={packs}"]
    out = run_train(tiny_overrides(tiny_folder, tmp_path / "out" / "x" / "run", *args))
    assert_clean_failure(out, "storage.compression='lz4': variant=lmdb_lz4 sets it")
    assert not packs.exists()


def test_a_variants_storage_keys_another_storage_takes_are_logged(caplog):
    """variant=raw_shards storage=lmdb packs an LMDB of raw pixels (LMDB takes kind=raw):
    the run says so."""
    import logging

    from fastload.engine import check_config
    from fastload.pipeline import build_storage

    cfg = compose_config(["variant=raw_shards", "storage=lmdb"])
    check_config(cfg)
    with caplog.at_level(logging.INFO, logger="fastload"):
        storage = build_storage(cfg)
    assert storage.kind == "raw"
    assert (
        "storage=lmdb with variant=raw_shards's storage.kind=raw, storage.size=null "
        "(variant=raw_shards is written for storage=shards)" in caplog.text
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+trainer.lr_typo=0.5"], "trainer has no option 'lr_typo', and nothing reads one"),
        (["+optim.lable_smoothing=0.2"], "Did you mean optim.label_smoothing=...?"),
        (["+seeed=3"], "the config has no option 'seeed'"),
        (["++trainer.epoch=3"], "Did you mean trainer.epochs=...?"),
        (["+loader.num_worker=3"], "DataLoaderStream takes no such argument"),
        # SGD takes it, but build_optimizer passes each group's weight decay itself
        (["+optim.optimizer.weight_decay=0.1"], "from optim.weight_decay, so this value would"),
    ],
)
def test_an_added_key_nothing_reads_is_refused_by_name(overrides, message):
    """Hydra refuses `trainer.lr_typo=0.5` and suggests `+trainer.lr_typo=0.5`, which then
    trained without the setting, exit 0."""
    from fastload.engine import check_config
    from fastload.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        check_config(compose_config(overrides))
    assert message in err.value.user_message
    assert err.value.user_message.startswith(overrides[0])


@pytest.mark.parametrize(
    "overrides",
    [
        ["+repeat=2"],  # the reproduce scripts' sweep axis
        ["++trainer.epochs=3"],  # an option the config has
        ["+hydra.job.env_set.OMP_NUM_THREADS=1"],
        ["storage=webdataset", "+storage.storage_options.endpoint_url=http://minio:9000"],
        ["+storage.shard_mb=64"],  # another storage's option: check_storage_options says
        ["+backend.scratch_dir=/tmp", "backend=accimage"],  # an argument of the backend's class
    ],
)
def test_an_added_key_something_reads_is_accepted(overrides):
    from fastload.added_keys import check_added_keys

    check_added_keys(compose_config(overrides))


def test_a_run_with_an_unread_added_key_stops_before_any_work(tmp_path):
    out = run_train(["debug=fast", "+trainer.lr_typo=0.5", f"output_root={tmp_path}"])
    assert out.returncode == 2, out.stdout + out.stderr
    assert "+trainer.lr_typo=0.5: trainer has no option 'lr_typo'" in out.stderr
    assert "Traceback" not in out.stderr
    assert not any(tmp_path.rglob("*.pt"))
