"""The optional C extensions (everything else is in pyproject.toml).

Both bind to their library at run time (dlopen of the copy that Pillow or the nvImageCodec
wheel installed), so nothing is linked here, and both are optional: without a C compiler or a
header the install goes on and the Python paths are used (`python -m fastload.doctor env` says
which). The nvImageCodec header comes from its wheel, a build requirement on Linux
(pyproject.toml's build-system), located here without importing the library.
"""

import importlib.util
import os
import sys

from setuptools import Extension, setup


def nvimgcodec_include() -> list[str]:
    try:
        spec = importlib.util.find_spec("nvidia.nvimgcodec")
    except ImportError:
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        include = os.path.join(folder, "include")
        if os.path.exists(os.path.join(include, "nvimgcodec.h")):
            return [include]
    return []


extensions = [
    # backend=turbo's region decoder over Pillow's libjpeg-turbo (fastload/decode/roi_libjpeg.py).
    Extension(
        "fastload.decode._jpeg_region",
        ["fastload/decode/_jpeg_region.c"],
        extra_compile_args=["-O2"],
        optional=True,
    ),
]
include = nvimgcodec_include()
if include and sys.platform == "linux":
    # backend=nvjpeg's batched decode with the GIL released (fastload/decode/nvimgcodec_batch.py).
    extensions.append(
        Extension(
            "fastload.decode._nvimgcodec_batch",
            ["fastload/decode/_nvimgcodec_batch.c"],
            include_dirs=["fastload/decode/cuda_shim", *include],
            depends=["fastload/decode/cuda_shim/cuda_runtime_api.h"],
            extra_compile_args=["-O2"],
            libraries=["dl"],
            optional=True,
        )
    )

setup(ext_modules=extensions)
