"""backend=pillow-simd: the PIL code path, but only when Pillow-SIMD is the loaded PIL.

Pillow-SIMD is a drop-in fork (same `PIL` package) whose resize/convert use SSE4/AVX2; the
JPEG decode itself is libjpeg-turbo in both. Asking for it and silently getting plain Pillow
would make every comparison lie, so this backend refuses to start instead.
"""

from __future__ import annotations

import PIL

from fastload.decode.base import Need
from fastload.decode.pil import PILBackend, pillow_flavour
from fastload.errors import ConfigError

INSTALL = "bash scripts/install_pillow_simd.sh"


class PillowSIMDBackend(PILBackend):
    name = "pillow-simd"

    @classmethod
    def needs(cls, options: dict, facts, on_cuda: bool) -> list[Need]:
        """x86 only; AVX2 for the usual build; the loaded PIL must be Pillow-SIMD."""
        out = []
        if facts.arch not in ("x86_64", "AMD64", "i686"):
            out.append(Need("CPU flags", "fatal", f"backend=pillow-simd on {facts.arch}: "
                            "Pillow-SIMD is x86 only (it does not build on aarch64)",
                            "Use backend=turbo (libjpeg-turbo, as fast or faster) or "
                            "backend=pil."))  # fmt: skip
        elif facts.cpu_flags is not None and "avx2" not in facts.cpu_flags:
            out.append(Need("CPU flags", "warn", "backend=pillow-simd on a CPU without AVX2: a "
                            "Pillow-SIMD built with -mavx2 (e.g. in an image built on another "
                            "machine) dies with 'Illegal instruction'",
                            "Rebuild it on this machine with `bash "
                            "scripts/install_pillow_simd.sh` (SSE4 build without AVX2), or use "
                            "backend=turbo."))  # fmt: skip
        if facts.pillow != "pillow-simd":
            out.append(Need("decoders", "fatal", "backend=pillow-simd, but the loaded PIL is "
                            "plain Pillow", "bash scripts/install_pillow_simd.sh, or backend=pil."))  # fmt: skip
        return out

    def __init__(self, draft: bool = False):
        if pillow_flavour() != "pillow-simd":
            raise ConfigError(
                f"backend=pillow-simd needs Pillow-SIMD, but the loaded PIL is plain Pillow "
                f"{PIL.__version__} ({PIL.__file__}). Replace it in this environment with "
                f"`{INSTALL}` (builds Pillow-SIMD with AVX2 where the CPU has it), or use "
                f"backend=pil."
            )
        super().__init__(draft=draft)
