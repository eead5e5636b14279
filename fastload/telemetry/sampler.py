"""Background sampling of GPU utilisation (NVML), host CPU and process-tree memory.

One daemon thread samples every `interval_s`; the engine opens a window per epoch with
`reset()` and reads it with `snapshot()`. NVML is optional: without a driver or GPU the
GPU fields stay None and training goes on.

Memory of the process tree (this process and its DataLoader workers), two figures in MiB:
* PSS summed over the tree (`peak_pss_mib`): each page shared by N processes counts 1/N in
  each, so the sum is the memory the run really holds; forked workers share most of their
  pages with the main process. Reading PSS walks each process's page tables
  (/proc/<pid>/smaps_rollup, ~10 ms for a torch process), so it is sampled every
  `pss_interval_s` and once at the start of every window, not every `interval_s`; always on
  the sampling thread. (A synchronous sample in `snapshot()` cost the training thread 0.1 s
  per epoch with 8 workers on 2 cores, ~0.4 s with 14 workers and CUDA on an H100 box:
  ~17 % of a 2.5 s epoch.) A window too short for any sample reports the last one taken.
* RSS summed over the tree (`peak_rss_sum_mib`): cheap, sampled every `interval_s`, but a
  shared page counts once per process: an upper bound that grows with the worker count.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil

log = logging.getLogger(__name__)

_MB = 1024 * 1024
# Listing children scans all of /proc (every process on the node), far dearer than reading
# the RSS of known pids; DataLoader workers only appear at an epoch's start, so rescan
# seldom, and on every reset().
_CHILDREN_RESCAN_S = 1.0


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def torch_device_identity(index: int) -> tuple[str | None, str | None]:
    """(uuid, pci_bus_id) of torch's CUDA device `index`, or (None, None) if unknown.

    torch numbers devices after CUDA_VISIBLE_DEVICES remapping while NVML numbers all
    physical GPUs, so the index alone can name the wrong GPU. Only asks torch when CUDA is
    already initialised: initialising it here could break a later fork.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None, None
    try:
        if not torch.cuda.is_initialized():
            return None, None
        props = torch.cuda.get_device_properties(index)
    except Exception as exc:  # any torch/CUDA trouble: fall back to the index
        log.debug("cannot read CUDA device %s properties: %s", index, exc)
        return None, None
    uuid = str(getattr(props, "uuid", "") or "") or None
    pci = None
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        pci = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    return uuid, pci


def _norm_uuid(u: Any) -> str:
    if isinstance(u, bytes):
        u = u.decode(errors="replace")
    u = str(u).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if u.startswith(prefix):
            u = u[len(prefix) :]
    return u


def resolve_nvml_handle(
    pynvml: Any, index: int, uuid: str | None = None, pci_bus_id: str | None = None
) -> Any:
    """NVML handle of torch device `index`: match by UUID, then PCI bus id, then index.

    The index fallback maps through a numeric CUDA_VISIBLE_DEVICES when one is set.
    Raises whatever NVML raises if nothing matches.
    """
    if uuid:
        want = _norm_uuid(uuid)
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                if _norm_uuid(pynvml.nvmlDeviceGetUUID(handle)) == want:
                    return handle
            except pynvml.NVMLError:
                continue
    if pci_bus_id:
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
        except pynvml.NVMLError:
            pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if index < len(entries) and entries[index].isdigit():
            return pynvml.nvmlDeviceGetHandleByIndex(int(entries[index]))
        if index < len(entries) and entries[index].lower().startswith(("gpu-", "mig-")):
            return pynvml.nvmlDeviceGetHandleByUUID(entries[index])
    return pynvml.nvmlDeviceGetHandleByIndex(index)


class ResourceSampler:
    """Samples GPU util/memory, host CPU % and process-tree RSS on one daemon thread.

    `gpu_index` is the torch CUDA device index of this rank (None: no GPU sampling).
    `snapshot()` keys: ``gpu_util_mean``, ``gpu_util_p10`` (percent), ``gpu_mem_used_max_mb``
    (None without NVML), ``cpu_percent`` (host-wide, mean over the window),
    ``peak_pss_mib`` and ``peak_rss_sum_mib`` (the process tree's memory, see the module
    doc; PSS is None where the OS cannot tell), ``resource_samples`` (samples in the window;
    named so it cannot clash with StepTimer's ``samples``).
    """

    def __init__(
        self, gpu_index: int | None = None, interval_s: float = 0.2, pss_interval_s: float = 5.0
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.gpu_index = gpu_index
        self.interval_s = float(interval_s)
        self.pss_interval_s = float(pss_interval_s)
        self._pss_at = -float("inf")
        self._lock = threading.Lock()  # guards the window
        self._tree_lock = threading.Lock()  # guards the children cache (two threads sample)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = psutil.Process(os.getpid())
        self._children: dict[int, psutil.Process] = {}
        self._children_scanned_at = -float("inf")
        self._device_identity: tuple[str | None, str | None] = (None, None)
        self._rss_last_mb: float | None = None  # the latest samples, for windows without one
        self._pss_last_mb: float | None = None
        # A tick's CPU % and GPU utilisation are averages since the tick before (psutil's and
        # NVML's), so a tick is kept only when no window boundary fell between the two: a
        # reset() (the last tick of an evaluation counted in the next epoch) or a paused()
        # one (a checkpoint written inside the epoch, left out of its utilisation). Each
        # bumps `_marks`; `_resets` counts resets alone (memory is read at an instant).
        self._paused = False
        self._marks = self._resets = 0
        self._clear_window()

    def _clear_window(self) -> None:
        self._gpu_util: list[float] = []
        self._gpu_mem_mb: list[float] = []
        self._cpu: list[float] = []
        self._rss_peak_mb: float | None = None
        self._pss_peak_mb: float | None = None
        self._samples = 0

    # -- public API ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the sampling thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        if self.gpu_index is not None:
            # Ask torch here, on the caller's thread, where CUDA was initialised.
            self._device_identity = torch_device_identity(self.gpu_index)
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name="fastload-resource-sampler", daemon=True
        )
        self._thread.start()

    def reset(self) -> None:
        """Start a new measurement window (e.g. at the start of an epoch)."""
        with self._lock:
            self._clear_window()
            self._marks += 1
            self._resets += 1
            self._children_scanned_at = -float("inf")  # new epoch, maybe new workers
            self._pss_at = -float("inf")  # the thread's next tick samples PSS for this window

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the GPU utilisation and CPU % of what runs inside out of the window (a
        checkpoint written inside an epoch, which StepTimer.outside leaves out of its time).
        Memory is still sampled: a peak reached then is the run's too."""
        with self._lock:
            self._paused = True
            self._marks += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused = False
                self._marks += 1

    def snapshot(self) -> dict[str, float | None]:
        """Summary of the current window; the thread keeps running. Reads what the thread
        sampled and samples nothing itself: it runs on the training thread, between epochs."""
        with self._lock:
            return {
                "gpu_util_mean": _mean(self._gpu_util),
                "gpu_util_p10": percentile(self._gpu_util, 10),
                "gpu_mem_used_max_mb": max(self._gpu_mem_mb) if self._gpu_mem_mb else None,
                "cpu_percent": _mean(self._cpu),
                "peak_pss_mib": self._pss_peak_mb or self._pss_last_mb,
                "peak_rss_sum_mib": self._rss_peak_mb or self._rss_last_mb,
                "resource_samples": float(self._samples),
            }

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and join the thread (idempotent)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def __enter__(self) -> ResourceSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- sampling -----------------------------------------------------------------------

    def _tree(self) -> list[psutil.Process]:
        """This process and its descendants (the children list is rescanned seldom)."""
        now = time.monotonic()
        if now - self._children_scanned_at >= _CHILDREN_RESCAN_S:
            try:
                kids = self._proc.children(recursive=True)
            except psutil.Error:
                kids = []
            # Keep known Process objects: psutil guards them against pid reuse.
            self._children = {p.pid: self._children.get(p.pid, p) for p in kids}
            self._children_scanned_at = now
        return [self._proc, *self._children.values()]

    def _tree_memory(self, pss: bool) -> tuple[int, int | None]:
        """(summed RSS, summed PSS or None) in bytes over the process tree."""
        with self._tree_lock:
            rss, pss_total = 0, 0 if pss else None
            for proc in self._tree():
                try:
                    rss += proc.memory_info().rss
                    if pss_total is not None:
                        value = getattr(proc.memory_full_info(), "pss", None)
                        pss_total = None if value is None else pss_total + value
                except psutil.Error:  # exited (or zombie) between listing and reading
                    if proc is not self._proc:
                        self._children.pop(proc.pid, None)
            return rss, pss_total

    def _sample_memory(self, pss: bool = False) -> None:
        resets = self._resets
        pss = pss or time.monotonic() - self._pss_at >= self.pss_interval_s
        try:
            rss, pss_bytes = self._tree_memory(pss)
        except Exception as exc:
            log.debug("memory sample failed: %s", exc)
            return
        with self._lock:
            if resets != self._resets:  # read before a reset(): not the new window's
                return
            if pss:
                self._pss_at = time.monotonic()
            self._rss_last_mb = rss / _MB
            self._rss_peak_mb = max(self._rss_peak_mb or 0.0, self._rss_last_mb)
            if pss_bytes is not None:
                self._pss_last_mb = pss_bytes / _MB
                self._pss_peak_mb = max(self._pss_peak_mb or 0.0, self._pss_last_mb)

    def _init_nvml(self) -> tuple[Any, Any] | tuple[None, None]:
        if self.gpu_index is None:
            return None, None
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # no package, no driver, no GPU: GPU fields stay None
            log.debug("NVML unavailable, GPU metrics disabled: %s", exc)
            return None, None
        try:
            uuid, pci = self._device_identity
            handle = resolve_nvml_handle(pynvml, self.gpu_index, uuid, pci)
        except Exception as exc:
            log.debug("no NVML handle for CUDA device %s: %s", self.gpu_index, exc)
            _nvml_shutdown(pynvml)
            return None, None
        return pynvml, handle

    def _run(self) -> None:
        pynvml, handle = self._init_nvml()
        # psutil keeps cpu_percent's last reading per thread: this first call primes ours.
        psutil.cpu_percent(interval=None)
        gpu_failed = False
        before = self._marks  # at the tick before: its readings start there
        try:
            while not self._stop.wait(self.interval_s):
                marks = self._marks
                try:
                    cpu = psutil.cpu_percent(interval=None)
                except Exception:
                    cpu = None
                util = mem_mb = None
                if handle is not None and not gpu_failed:
                    try:
                        util = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                        mem_mb = pynvml.nvmlDeviceGetMemoryInfo(handle).used / _MB
                    except Exception as exc:  # e.g. MIG slices report no utilisation
                        log.debug("NVML sampling failed, GPU metrics disabled: %s", exc)
                        gpu_failed = True
                self._sample_memory()
                with self._lock:
                    spans = not before == marks == self._marks  # a boundary since the last
                    before = marks
                    if spans or self._paused:
                        continue
                    self._samples += 1
                    if cpu is not None:
                        self._cpu.append(cpu)
                    if util is not None:
                        self._gpu_util.append(util)
                    if mem_mb is not None:
                        self._gpu_mem_mb.append(mem_mb)
        finally:
            if pynvml is not None:
                _nvml_shutdown(pynvml)


def _nvml_shutdown(pynvml: Any) -> None:
    try:
        pynvml.nvmlShutdown()
    except Exception:
        pass
