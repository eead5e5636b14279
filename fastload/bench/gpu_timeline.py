"""Where a profiled window's GPU time went, read from torch.profiler's Chrome trace (Kineto):
per CUDA stream the kernel and copy time and the share of the window it kept busy, its
heaviest kernels, and the host calls that block until the GPU (or its allocator) catches up.

`bench train --profile` profiles one extra epoch of the run and of its ceiling and prints
both: a data path that takes GPU time from the model (backend=nvjpeg's decode and crop on a
side stream) shows up as kernels on another stream and as the model's stream busy for less of
the window than in the ceiling; a library that frees or synchronises per batch shows up in
the blocking calls. The trace files open in Perfetto (ui.perfetto.dev) or chrome://tracing.

Why the model's stream sat idle: each gap between two of its kernels (or copies) is charged
to the host when the call that launched the kernel after the gap returned only after the
stream went idle (the GPU waited for the host's launches: launch-bound, or a host thread held
back by another's work), else to waiting (an event from another stream, a dependency on the
GPU). On an H200, ResNet-50 compiled at batch 256 is launch-bound even in the ceiling (the
GPU busy ~74 %), so host work beside the training thread shows up here first.
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
TOP_STREAMS = 4  # the rest are summed into one row (nvImageCodec alone uses dozens)


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
    """{"window_ms", "gpu_busy_share", "streams": [...], "blocking": [...], "idle"} of a trace;
    streams heaviest first (the first is the model's where the model dominates), each with
    kernels_ms, copies_ms, busy_share and its top kernels; blocking host calls by total time;
    `idle`: why the heaviest stream sat idle (see idle())."""
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if not spans:
        return {
            "window_ms": 0.0,
            "gpu_busy_share": None,
            "streams": [],
            "blocking": [],
            "idle": None,
        }
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
                                         "by_name": {}, "ops": []})  # fmt: skip
            s[GPU_WORK[cat]] += dur / 1000
            s["ops"].append(e)
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
    model = rows[0]["stream"] if rows else None  # the heaviest stream: the model's
    return {
        "window_ms": window / 1000,
        "gpu_busy_share": union_us(everything) / window if everything and window else None,
        "streams": rows,
        "blocking": sorted(calls.values(), key=lambda c: -c["total_ms"]),
        "idle": idle(trace["traceEvents"], model, streams[model]["ops"]) if rows else None,
    }


def idle(events: list, stream, ops: list) -> dict:
    """{"stream", "span_ms", "idle_ms", "host_ms", "waiting_ms", "host_by_thread"} of one
    stream, whose GPU operations (trace events) are `ops`: the gaps between them from its
    first to its last, charged to the host when the operation after the gap was launched by a
    call that returned after the gap began (per launching thread, by name), else to waiting."""
    ops = sorted(ops, key=lambda e: float(e["ts"]))
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in HOST_CALLS
        and "correlation" in (e.get("args") or {})
    }
    names: dict = {}  # Kineto names a thread more than once ("pt_autograd_0", "python")
    for e in events:
        if (
            e.get("ph") == "M"
            and e.get("name") == "thread_name"
            and "name" in (e.get("args") or {})
        ):
            key = (e.get("pid"), e.get("tid"))
            if key not in names or names[key].endswith("(python)"):
                names[key] = e["args"]["name"]
    out = {"stream": stream, "span_ms": 0.0, "idle_ms": 0.0, "host_ms": 0.0, "waiting_ms": 0.0,
           "host_by_thread": {}}  # fmt: skip
    if not ops:
        return out
    start, end = float(ops[0]["ts"]), float(ops[0]["ts"]) + float(ops[0]["dur"])
    out["span_ms"] = (max(float(e["ts"]) + float(e["dur"]) for e in ops) - start) / 1000
    for e in ops[1:]:
        ts = float(e["ts"])
        if ts > end:  # a gap from `end` to `ts`
            gap = (ts - end) / 1000
            out["idle_ms"] += gap
            call = launches.get((e.get("args") or {}).get("correlation"))
            if call is not None and float(call["ts"]) + float(call["dur"]) > end:
                out["host_ms"] += gap
                who = names.get((call.get("pid"), call.get("tid")), f"thread {call.get('tid')}")
                out["host_by_thread"][who] = out["host_by_thread"].get(who, 0.0) + gap
            else:
                out["waiting_ms"] += gap
        end = max(end, ts + float(e["dur"]))
    return out


def summarize_file(path: str | Path) -> dict:
    return summarize(json.loads(Path(path).read_text()))


def table_rows(label: str, summary: dict) -> tuple[list[dict], list[dict]]:
    """(stream rows, blocking-call rows) of one summary, for format_table, labelled: the
    TOP_STREAMS heaviest streams, then one row summing the others."""
    streams = [
        {
            "loop": label,
            "stream": r["stream"],
            "kernels_ms": r["kernels_ms"],
            "copies_ms": r["copies_ms"],
            "busy_share": r["busy_share"],
            "top_kernels": "; ".join(r["top_kernels"]),
        }
        for r in summary["streams"][:TOP_STREAMS]
    ]
    rest = summary["streams"][TOP_STREAMS:]
    if rest:
        streams.append({
            "loop": label,
            "stream": f"{len(rest)} more",
            "kernels_ms": sum(r["kernels_ms"] for r in rest),
            "copies_ms": sum(r["copies_ms"] for r in rest),
            "busy_share": None,
            "top_kernels": "",
        })  # fmt: skip
    calls = [{"loop": label, **c} for c in summary["blocking"]]
    return streams, calls


def idle_line(summary: dict) -> str | None:
    """Why the model's stream sat idle, in one line, or None without GPU activity."""
    i = summary.get("idle")
    if not i or not i["span_ms"]:
        return None
    threads = ", ".join(
        f"{name} {ms:,.0f} ms"
        for name, ms in sorted(i["host_by_thread"].items(), key=lambda kv: -kv[1])
    )
    return (
        f"stream {i['stream']} idle {i['idle_ms']:,.0f} ms of its {i['span_ms']:,.0f} ms: "
        f"the host late {i['host_ms']:,.0f} ms"
        + (f" ({threads})" if threads else "")
        + f", waiting {i['waiting_ms']:,.0f} ms"
    )
