#!/usr/bin/env bash
# Replace Pillow by Pillow-SIMD in the current Python environment (backend=pillow-simd).
#
#   bash scripts/install_pillow_simd.sh                  # the `python` on PATH (your venv)
#   PYTHON=/path/to/venv/bin/python bash scripts/install_pillow_simd.sh
#   PILLOW_SIMD_VERSION=12.1.1.post0 bash scripts/install_pillow_simd.sh
#
# * AVX2 is used only where /proc/cpuinfo lists it: a -mavx2 build crashes with "illegal
#   instruction" on CPUs without it (pillow-simd#30). Without AVX2 the build uses SSE4 on
#   x86_64; on aarch64 it builds without x86 flags and gains nothing over Pillow (the SIMD
#   code paths are x86-only), so the script says so.
# * Pillow-SIMD has no wheels: it is compiled here and needs the JPEG/zlib headers. With apt
#   and root they are installed; otherwise the script prints what to install and stops.
# * The distribution is named "pillow-simd", so `pip check` reports torchvision's "pillow"
#   requirement as missing; `import PIL` (all torchvision uses) works. Another `pip install`
#   that pulls in "pillow" puts plain Pillow back on top: re-run this script afterwards.
set -euo pipefail

# It takes no arguments: any (--help included) prints the header above and changes nothing.
if [[ $# -gt 0 ]]; then
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
    [[ "$1" == "-h" || "$1" == "--help" ]] && exit 0
    echo "install_pillow_simd.sh takes no arguments (got: $*); set PYTHON= or PILLOW_SIMD_VERSION= instead" >&2
    exit 2
fi

PYTHON="${PYTHON:-python}"
VERSION="${PILLOW_SIMD_VERSION:-12.1.1.post0}"
DEBS="libjpeg-dev zlib1g-dev libpng-dev libtiff-dev libfreetype-dev liblcms2-dev libwebp-dev"

say() { printf '[install_pillow_simd] %s\n' "$*"; }

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' || {
    say "Pillow-SIMD ${VERSION} needs Python >= 3.10 (PYTHON=${PYTHON})"
    exit 1
}

arch="$(uname -m)"
cflags=""
case "$arch" in
    x86_64 | amd64 | i?86)
        if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
            cflags="-mavx2"
            say "x86 CPU with AVX2: building with -mavx2"
        else
            cflags="-msse4"
            say "x86 CPU without AVX2: building with SSE4 only (an AVX2 build would crash here)"
        fi
        ;;
    aarch64 | arm64)
        say "aarch64: building without x86 SIMD flags; Pillow-SIMD's speed-ups are x86-only," \
            "so expect Pillow's speed (backend=pil is the sensible choice here)"
        ;;
    *)
        say "unknown architecture ${arch}: building without SIMD flags"
        ;;
esac

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing build dependencies with apt-get: ${DEBS}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential ${DEBS} >/dev/null
elif ! printf '#include <jpeglib.h>\n#include <zlib.h>\n' | cc -E -x c - >/dev/null 2>&1; then
    say "missing the JPEG/zlib development headers and cannot install them (needs apt and root)."
    say "Debian/Ubuntu: sudo apt-get install build-essential ${DEBS}"
    say "Fedora/RHEL:   sudo dnf install gcc libjpeg-turbo-devel zlib-devel libpng-devel"
    say "macOS:         brew install jpeg-turbo zlib libpng"
    exit 1
fi

say "removing Pillow from $("$PYTHON" -c 'import sys; print(sys.prefix)')"
"$PYTHON" -m pip uninstall -y -q pillow pillow-simd || true

say "building pillow-simd==${VERSION} (a few minutes)"
CC="cc ${cflags}" "$PYTHON" -m pip install -q --no-cache-dir --no-binary pillow-simd \
    "pillow-simd==${VERSION}"

say "verifying"
"$PYTHON" - <<'EOF'
import io

import PIL
from PIL import Image, features

assert ".post" in PIL.__version__, f"plain Pillow {PIL.__version__} is still the loaded PIL"
buf = io.BytesIO()
Image.new("RGB", (64, 48), (200, 30, 90)).save(buf, "JPEG", quality=90)
img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
assert img.size == (64, 48), img.size
img.resize((32, 24), Image.BILINEAR)
print(
    f"[install_pillow_simd] OK: Pillow-SIMD {PIL.__version__} from {PIL.__file__}; "
    f"JPEG decode works (libjpeg-turbo: {features.check_feature('libjpeg_turbo')})"
)
EOF
