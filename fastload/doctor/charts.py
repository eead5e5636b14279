"""The doctor's PNG (matplotlib, headless): a waterfall of one image's way through a worker
(each stage's milliseconds stacked on the previous ones), and next to it every stage's
images/s for the machine, the bounding one in red, the model's appetite as a line."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402

WORKER = ("storage read", "decode", "augment", "collate")
WORKER_NAMES = ("storage", "decode", "augment", "collate")  # the bound's names for them
BOUND_ROWS = {
    "storage": "storage read",
    "decode": "decode",
    "augment": "augment",
    "collate": "collate",
    "transfer": "transfer + device prep",
    "model": "model step",
    "boundary": "epoch boundary (amortised)",
}


def waterfall(report, path) -> None:
    rows = {r["stage"]: r for r in report.stages}
    bound = report.bound
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), width_ratios=(1, 1.2))
    start = 0.0
    names = list(WORKER) + ["workers together (predicted)"]
    for i, name in enumerate(WORKER):
        ms = rows[name]["ms_per_img"] or 0.0
        colour = "tab:red" if BOUND_ROWS.get(bound["stage"]) == name else "tab:blue"
        left.barh(i, ms, left=start, color=colour)
        left.text(start + ms, i, f" {ms:.2f}", va="center", fontsize=8)
        start += ms
    left.barh(len(WORKER), start, color="tab:gray")
    left.text(start, len(WORKER), f" {start:.2f}", va="center", fontsize=8)
    left.set_yticks(range(len(names)), names)
    left.invert_yaxis()
    left.set_xlabel("milliseconds per image, one core (stacked)")
    left.set_title("one image through a worker")
    labels, values, colours = [], [], []
    for r in report.stages:
        if r["img_s_machine"] is None:
            continue
        labels.append(r["stage"])
        values.append(r["img_s_machine"])
        hit = BOUND_ROWS.get(bound["stage"]) == r["stage"]
        hit = hit or (
            bound["stage"] in WORKER_NAMES and r["stage"].startswith("workers together (m")
        )
        colours.append("tab:red" if hit else "tab:blue")
    right.barh(range(len(values)), values, color=colours)
    for i, v in enumerate(values):
        right.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    right.set_yticks(range(len(labels)), labels)
    right.invert_yaxis()
    right.set_xscale("log")
    right.set_xlabel("images/s for the machine (log scale)")
    model = bound.get("model_img_s")
    if model and model != float("inf"):
        right.axvline(model, color="k", linestyle="--", linewidth=1, label="the model's appetite")
        right.legend(loc="lower right", fontsize=8)
    right.set_title(f"bound: {bound['stage']} at {bound['img_s']:,.0f} img/s")
    fig.suptitle(f"fastload doctor: {bound['message']}", fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
