"""Where a profiled window's GPU time went, read from torch.profiler's Chrome trace (Kineto):
per CUDA stream the kernel and copy time and the share of the window it kept busy, its
heaviest kernels, and the host calls that block until the GPU (or its allocator) catches up.

`bench train --profile` profiles one extra epoch of the run and of its ceiling and prints
both: a data path that takes GPU time from the model (backend=nvjpeg's decode and crop on a
side stream) shows up as kernels on another stream and as the model's stream busy for less of
the window than in the ceiling; a library that frees or synchronises per batch shows up in
the blocking calls. The trace files open in Perfetto (ui.perfetto.dev) or chrome://tracing.
"""

from __future__ import annotations

import json
from pathlib import Path

GPU_WORK = {"kernel": "kernels_ms", "gpu_memcpy": "copies_ms", "gpu_memset": "copies_ms"}
HOST_CALLS = ("cuda_runtime", "cuda_driver")  # (Kineto's "cuda_sync" repeats their waits)
# Host calls that wait for the GPU: a synchronisation, or an allocator call that implies one
# (cudaFree waits for the whole device; a pageable cudaMemcpy for its stream).
BLOCKING = (
    "Synchronize",
    "cudaFree",
    "cudaFreeHost",
    "cudaMalloc",
    "cudaMallocHost",
    "cudaHostAlloc",
    "cudaHostRegister",
    "cudaMemcpy",
    "cuMemFree",
    "cuMemAlloc",
    "cuMemcpyHtoD",
    "cuMemcpyDtoH",
)
TOP_KERNELS = 3
NAME_CHARS = 48


def blocking(name: str) -> bool:
    if "Async" in name:  # cudaMemcpyAsync, cudaFreeAsync: stream-ordered, not host-blocking
        return "Synchronize" in name
    return any(b in name for b in BLOCKING)


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of the (start, end) intervals."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def summarize(trace: dict) -> dict:
    """{"window_ms", "gpu_busy_share", "streams": [...], "blocking": [...]} of a trace; streams
    heaviest first (the first is the model's where the model dominates), each with kernels_ms,
    copies_ms, busy_share and its top kernels; blocking host calls by total time."""
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if not spans:
        return {"window_ms": 0.0, "gpu_busy_share": None, "streams": [], "blocking": []}
    t0 = min(float(e["ts"]) for e in spans)
    window = max(float(e["ts"]) + float(e["dur"]) for e in spans) - t0
    streams: dict = {}
    calls: dict = {}
    everything = []
    for e in spans:
        cat, start, dur = e.get("cat"), float(e["ts"]), float(e["dur"])
        if cat in GPU_WORK:
            args = e.get("args") or {}
            key = args.get("stream", e.get("tid"))
            s = streams.setdefault(key, {"kernels_ms": 0.0, "copies_ms": 0.0, "spans": [],
                                         "by_name": {}})  # fmt: skip
            s[GPU_WORK[cat]] += dur / 1000
            s["spans"].append((start, start + dur))
            everything.append((start, start + dur))
            if cat == "kernel":
                s["by_name"][e["name"]] = s["by_name"].get(e["name"], 0.0) + dur / 1000
        elif cat in HOST_CALLS and blocking(e.get("name", "")):
            c = calls.setdefault(e["name"], {"call": e["name"], "count": 0, "total_ms": 0.0,
                                             "max_ms": 0.0})  # fmt: skip
            c["count"] += 1
            c["total_ms"] += dur / 1000
            c["max_ms"] = max(c["max_ms"], dur / 1000)
    rows = []
    for key, s in streams.items():
        top = sorted(s["by_name"].items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
        rows.append(
            {
                "stream": key,
                "kernels_ms": s["kernels_ms"],
                "copies_ms": s["copies_ms"],
                "busy_share": union_us(s["spans"]) / window if window else None,
                "top_kernels": [f"{name[:NAME_CHARS]} {ms:.1f} ms" for name, ms in top],
            }
        )
    rows.sort(key=lambda r: -(r["kernels_ms"] + r["copies_ms"]))
    return {
        "window_ms": window / 1000,
        "gpu_busy_share": union_us(everything) / window if everything and window else None,
        "streams": rows,
        "blocking": sorted(calls.values(), key=lambda c: -c["total_ms"]),
    }


def summarize_file(path: str | Path) -> dict:
    return summarize(json.loads(Path(path).read_text()))


def table_rows(label: str, summary: dict) -> tuple[list[dict], list[dict]]:
    """(stream rows, blocking-call rows) of one summary, for format_table, labelled."""
    streams = [
        {
            "loop": label,
            "stream": r["stream"],
            "kernels_ms": r["kernels_ms"],
            "copies_ms": r["copies_ms"],
            "busy_share": r["busy_share"],
            "top_kernels": "; ".join(r["top_kernels"]),
        }
        for r in summary["streams"]
    ]
    calls = [{"loop": label, **c} for c in summary["blocking"]]
    return streams, calls
