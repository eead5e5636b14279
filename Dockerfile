# fastload training image: the project in a venv at /opt/venv, the code in /app.
#
# Build (behind a TLS-inspecting proxy, first copy its CA certificates into the context;
# they are git-ignored, see docker/certs/README.md):
#   cp /usr/local/share/ca-certificates/*.crt docker/certs/
#   docker build -t fastload .
#   docker build --build-arg BASE_IMAGE=local/bookworm:base -t fastload .   # bare Debian base
#   docker build --build-arg PIP_INDEX_URL=https://download.pytorch.org/whl/cpu \
#                --build-arg PIP_EXTRA_INDEX_URL=https://pypi.org/simple -t fastload:cpu .
#
# Run (PyPI's torch wheels carry their own CUDA libraries; the host needs only the driver and
# the NVIDIA container toolkit; DataLoader workers need a bigger /dev/shm than Docker's 64 MB):
#   docker run --rm --gpus all --shm-size=8g -v /data:/data -v "$PWD/outputs:/app/outputs" \
#     -v fastload-cache:/cache fastload python train.py dataset=imagenet dataset.root=/data/imagenet
#   docker run --rm --gpus all --shm-size=8g --ipc=host fastload \
#     torchrun --nproc_per_node=8 train.py model=resnet50
#
# Paths: runs are written to /app/outputs (output_root), the synthetic dataset is generated
# under /cache (FASTLOAD_CACHE); mount both to keep them. The entrypoint (docker/entrypoint.sh)
# never trains as root: it runs the command as the owner of the mounted /app/outputs (you, so
# the files are yours), else as the image's `fastload` user (uid 1000); `--user` is kept. With
# more than one GPU visible, `python train.py ...` starts one process per GPU through torchrun
# (FASTLOAD_NPROC=1 for a single one). W&B is offline by default (files in the run
# directory); pass -e WANDB_API_KEY=... and logger.mode=online to stream.

ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# Optional package index overrides: a mirror, the CPU-only torch index for a small image, or
# https://download.pytorch.org/whl/cuXYZ where the host driver is too old for the CUDA
# version that PyPI's default torch wheel is built with (check `nvidia-smi`).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    DEBIAN_FRONTEND=noninteractive

# 1. Extra CA certificates first, so that every later download (apt over https, pip, W&B)
#    trusts the proxy. Then Python, the venv module and ca-certificates from apt, but only
#    where the base image lacks them (python:*-slim has all three; a bare Debian has none).
#    The apt packages are not pinned (DL3008): which versions exist depends on the base's
#    Debian release and point release (a python:*-slim tag or a local bookworm rootfs), so a
#    pin would break the build at the next Debian point release; these are the distribution's
#    own python3/ca-certificates, and the Python dependencies are pinned by pip below.
COPY docker/certs/ /tmp/extra-certs/
# hadolint ignore=DL3008
RUN set -eu; \
    mkdir -p /usr/local/share/ca-certificates/extra; \
    for crt in /tmp/extra-certs/*.crt; do \
        if [ -f "$crt" ]; then cp "$crt" /usr/local/share/ca-certificates/extra/; fi; \
    done; \
    rm -rf /tmp/extra-certs; \
    if [ ! -s /etc/ssl/certs/ca-certificates.crt ] \
       && ls /usr/local/share/ca-certificates/extra/*.crt >/dev/null 2>&1; then \
        mkdir -p /etc/ssl/certs; \
        cat /usr/local/share/ca-certificates/extra/*.crt > /etc/ssl/certs/ca-certificates.crt; \
    fi; \
    set --; \
    command -v update-ca-certificates >/dev/null 2>&1 || set -- "$@" ca-certificates; \
    if ! command -v python3 >/dev/null 2>&1; then \
        set -- "$@" python3 python3-venv; \
    elif ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then \
        set -- "$@" python3-venv; \
    fi; \
    if [ "$#" -gt 0 ]; then \
        apt-get update; \
        apt-get install -y --no-install-recommends "$@"; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    update-ca-certificates

# 2. The venv, on PATH for every later step and at run time (`python` is the venv's). pip is
#    pinned (DL3013) so that a rebuild gets the same resolver and wheel-tag rules.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv \
    && python -m pip install --upgrade pip==26.3

# 3. Dependencies: their own layer, rebuilt only when pyproject.toml changes. Installing the
#    project with empty stub packages (pyproject.toml's package list) pulls every dependency
#    (the optional C extension has no source yet and is skipped); the stub is uninstalled again
#    so that this layer holds the dependencies only (the code itself comes in step 4).
WORKDIR /app
COPY pyproject.toml ./
RUN python -c "import os, tomllib; \
cfg = tomllib.load(open('pyproject.toml', 'rb'))['tool']['setuptools']; \
dirs = [cfg['package-dir'].get(p, p.replace('.', '/')) for p in cfg['packages']]; \
[os.makedirs(d, exist_ok=True) or open(d + '/__init__.py', 'a').close() for d in dirs]" \
    && pip install . \
    && pip uninstall -y fastload \
    && rm -rf fastload models build ./*.egg-info

# 4. The source (what .dockerignore lets through: train.py, conf/, fastload/, scripts/,
#    README.md, ...; not tests/). One copy of the code, in /app: the editable install puts
#    only a path hook into site-packages (no second copy of fastload there), so `import
#    fastload` is /app/fastload from any folder, and fastload.config.conf_dir() finds /app/conf
#    beside it. No dependency is touched (--no-deps). The check runs isolated (-I: the current
#    folder is not on sys.path), so it sees what an import from elsewhere sees.
#    The editable install compiles fastload's C extensions in place (setup.py): backend=turbo's
#    region decoder (fastload/decode/_jpeg_region.c) and backend=nvjpeg's batched decode call
#    (_nvimgcodec_batch.c, against the header of the nvImageCodec wheel that pip fetches as a
#    build requirement); their compiler and headers (gcc, libjpeg 6.2 headers, Python.h where
#    the base lacks it) are removed again in the same layer, and the checks below fail the
#    build if either did not build or bind to its library (nvImageCodec's CPU decoder loads
#    without a GPU). Not pinned
#    (DL3008), for the reason given in step 1.
COPY . .
# hadolint ignore=DL3008
RUN set -eu; \
    set -- gcc libc6-dev libjpeg62-turbo-dev; \
    python -c "import os, sys, sysconfig; \
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
        || set -- "$@" python3-dev; \
    apt-get update; \
    apt-get install -y --no-install-recommends "$@"; \
    pip install --no-deps -e .; \
    apt-get purge -y --auto-remove "$@"; \
    rm -rf /var/lib/apt/lists/*; \
    python -c "from fastload.decode import roi_decoders as r; s = r.status(); assert not s['libjpeg'], s"; \
    python -c "from fastload.decode import nvimgcodec_batch as n; assert n.choose('c')"; \
    install -m 0755 docker/entrypoint.sh /usr/local/bin/fastload-entrypoint \
    && rm -rf build ./*.egg-info docker \
    && useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin fastload \
    && mkdir -p /cache /app/outputs \
    && chmod 1777 /cache /app/outputs \
    && python -I -c "import fastload, fastload.models, torch, torchvision, hydra; \
from fastload.config import conf_dir; \
assert fastload.__file__ == '/app/fastload/__init__.py', fastload.__file__; \
assert str(conf_dir()) == '/app/conf', conf_dir()"

ENV FASTLOAD_CACHE=/cache

ENTRYPOINT ["/usr/local/bin/fastload-entrypoint"]
CMD ["python", "train.py"]
