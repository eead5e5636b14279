"""backend=pillow-simd: the PIL code path, but only when Pillow-SIMD is the loaded PIL.

Pillow-SIMD is a drop-in fork (same `PIL` package) whose resize/convert use SSE4/AVX2; the
JPEG decode itself is libjpeg-turbo in both. Asking for it and silently getting plain Pillow
would make every comparison lie, so this backend refuses to start instead.
"""

from __future__ import annotations

import PIL

from fastload.decode.pil import PILBackend, pillow_flavour
from fastload.errors import ConfigError

INSTALL = "bash scripts/install_pillow_simd.sh"


class PillowSIMDBackend(PILBackend):
    name = "pillow-simd"

    def __init__(self, draft: bool = False):
        if pillow_flavour() != "pillow-simd":
            raise ConfigError(
                f"backend=pillow-simd needs Pillow-SIMD, but the loaded PIL is plain Pillow "
                f"{PIL.__version__} ({PIL.__file__}). Replace it in this environment with "
                f"`{INSTALL}` (builds Pillow-SIMD with AVX2 where the CPU has it), or use "
                f"backend=pil."
            )
        super().__init__(draft=draft)
