"""backend=nvjpeg's batched decode call without Python in it: `_nvimgcodec_batch.c`, a C
extension over nvImageCodec's C API, built at install time like the region decoder.

Why: backend=nvjpeg decodes in loader=prefetch's prep thread, beside a training thread whose
compiled step is launch-bound (it waits for the GIL between kernel launches). Through
nvImageCodec's Python binding a 256-image batch costs one CodeStream object per image and one
GIL hand-off per image inside the decode call; the C call parses, decodes and waits for the
whole batch with the GIL released and returns one status byte per image.

`backend.binding` picks the call: `auto` (this one where it is built, else the binding), `c`
(this one, or an error naming how to build it) or `python` (nvImageCodec's binding). Both give
the same pixels (tests/test_backends.py compares them).
"""

from __future__ import annotations

import os
import threading

from fastload.errors import ConfigError

BINDINGS = ("auto", "c", "python")
BUILD_HINT = (
    "fastload's batched nvImageCodec call (fastload/decode/_nvimgcodec_batch.c) is not built: "
    "it needs a C compiler and nvImageCodec's header, which pip fetches as a build "
    "requirement (pip install -e . again, with gcc installed)"
)
# nvimgcodecBackendKind_t (nvimgcodec.h)
CPU_ONLY, GPU_ONLY, HYBRID_CPU_GPU, HW_GPU_ONLY = 1, 2, 3, 4
DEVICE_CPU_ONLY = -99999  # NVIMGCODEC_DEVICE_CPU_ONLY
# decode()'s per-image codes: 0 decoded; otherwise why the image was not
REFUSALS = {1: "unparsable", 2: "larger than its slot", 3: "refused by the decoder"}

UNAVAILABLE_REASON = ""
_EXT = None
_LOADED = False
_LOCK = threading.Lock()  # the prep thread and an evaluation loader may both ask first


def _load():
    """The bound extension module, or None (the reason in UNAVAILABLE_REASON). Needs
    nvidia.nvimgcodec loaded first (roi_nvimgcodec.load(): its extensions and nvJPEG)."""
    global _EXT, _LOADED, UNAVAILABLE_REASON
    if _LOADED:
        return _EXT
    _LOADED = True
    try:
        from fastload.decode import _nvimgcodec_batch as ext
    except ImportError:
        UNAVAILABLE_REASON = BUILD_HINT
        return None
    try:
        from nvidia import nvimgcodec

        ext.load(os.path.join(os.path.dirname(nvimgcodec.__file__), "libnvimgcodec.so.0"))
    except (ImportError, OSError) as e:
        UNAVAILABLE_REASON = f"fastload's batched nvImageCodec call did not load: {e}"
        return None
    _EXT = ext
    return _EXT


def built() -> bool:
    """Whether the extension is installed (without loading it or nvImageCodec)."""
    import importlib.util

    return importlib.util.find_spec("fastload.decode._nvimgcodec_batch") is not None


def choose(binding: str):
    """The extension for backend.binding ('auto', 'c', 'python'), or None for nvImageCodec's
    Python binding; ConfigError for 'c' where the extension does not load."""
    if binding == "python":
        return None
    from fastload.decode import roi_nvimgcodec

    with _LOCK:
        roi_nvimgcodec.load()  # the library, its extensions and nvJPEG, as the binding has them
        ext = _load()
    if ext is None and binding == "c":
        raise ConfigError(f"backend.binding=c: {UNAVAILABLE_REASON}; or backend.binding=auto.")
    return ext
