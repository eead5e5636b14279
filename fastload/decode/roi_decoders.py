"""The region decoders backend=turbo can use (fastload/decode/roi.py says what they share),
in the order `backend.roi=auto` tries them, and which of them load here."""

from __future__ import annotations

KINDS = ("libjpeg", "nvimgcodec")


def candidates(roi: str) -> tuple[str, ...]:
    """The region decoders a `backend.roi` value asks for, in the order they are tried:
    auto / on every kind, off none, a kind's name that one."""
    return {"auto": KINDS, "on": KINDS, "off": ()}.get(roi, (roi,))


def make_decoder(roi: str, fastdct: bool, fastupsample: bool):
    """The first region decoder of `candidates(roi)` that loads. ImportError naming why
    (each kind's reason, with its fix) when none does."""
    reasons = []
    for name in candidates(roi):
        module = _module(name)
        if module.load() is not None:
            return module.Decoder(fastdct=fastdct, fastupsample=fastupsample)
        reasons.append(f"{name}: {module.UNAVAILABLE_REASON}")
    raise ImportError("; ".join(reasons))


def status() -> dict[str, str]:
    """Each kind's state: "" when it loads, else why not (with the fix)."""
    out = {}
    for name in KINDS:
        module = _module(name)
        out[name] = "" if module.load() is not None else module.UNAVAILABLE_REASON
    return out


def _module(kind: str):
    if kind == "libjpeg":
        from fastload.decode import roi_libjpeg

        return roi_libjpeg
    if kind == "nvimgcodec":
        from fastload.decode import roi_nvimgcodec

        return roi_nvimgcodec
    raise ValueError(f"no region decoder {kind!r}: use one of {', '.join(KINDS)}")
