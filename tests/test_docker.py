"""The Docker image: a cheap static check of Dockerfile/.dockerignore that runs everywhere, and
the real thing (build the image, print the config, train a tiny run inside it) under the
`docker` marker:  pytest -m docker tests/test_docker.py

The image is built from FASTLOAD_DOCKER_BASE (default local/bookworm:base: a bare Debian
bookworm rootfs without Python, made where no registry is reachable by docker-local-base.sh,
i.e. debootstrap + `docker import`); set FASTLOAD_DOCKER_BASE=python:3.11-slim-bookworm to
test the default base. The tag is FASTLOAD_DOCKER_TAG (default fastload:test); rebuilding
reuses Docker's layer cache, so only the first build downloads torch (several GB).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
CERTS = REPO / "docker" / "certs"
HOST_CERTS = Path("/usr/local/share/ca-certificates")
BASE_IMAGE = os.environ.get("FASTLOAD_DOCKER_BASE", "local/bookworm:base")
TAG = os.environ.get("FASTLOAD_DOCKER_TAG", "fastload:test")
CONFIG_GROUPS = ("dataset", "storage", "backend", "loader", "model", "optim", "logger", "trainer")


def dockerfile_instructions() -> list[str]:
    """The Dockerfile's instructions, one string each, continuation lines joined."""
    instructions, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        instructions.append(current + line)
        current = ""
    if current:
        instructions.append(current)
    return instructions


def first_index(instructions: list[str], pattern: str) -> int:
    for i, text in enumerate(instructions):
        if re.search(pattern, text):
            return i
    raise AssertionError(f"no Dockerfile instruction matches {pattern!r}")


# -- static checks: no Docker needed -----------------------------------------------------------


def test_dockerfile_trusts_extra_ca_certificates_before_any_download():
    steps = dockerfile_instructions()
    copy_certs = first_index(steps, r"^COPY\s+docker/certs/?\s")
    update_ca = first_index(steps, r"^RUN .*update-ca-certificates")
    first_pip = first_index(steps, r"^RUN .*pip install")
    assert copy_certs < update_ca < first_pip, steps
    # apt-get (which may go over https) only after the certificates are in place
    apt = [i for i, s in enumerate(steps) if "apt-get install" in s]
    assert all(i >= copy_certs for i in apt), steps
    # pip, requests (W&B) and OpenSSL use the system bundle, which includes the extra certs
    env = " ".join(s for s in steps[:first_pip] if s.startswith("ENV"))
    for var in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        assert f"{var}=/etc/ssl/certs/ca-certificates.crt" in env, var
    assert steps[0] == "ARG BASE_IMAGE=python:3.11-slim-bookworm"
    assert steps[-1] == 'CMD ["python", "train.py"]'


def test_build_context_excludes_local_state_but_keeps_the_certs_folder():
    ignored = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for path in (".venv", "outputs", "multirun", "wandb", ".git", "*.pt"):
        assert path in ignored, f".dockerignore should exclude {path}"
    for path in ("docker", "docker/certs", "conf", "fastload", "models", "train.py"):
        assert path not in ignored, f".dockerignore must not exclude {path}"
    # the copied certificates are build input only, never committed
    assert "*" in (CERTS / ".gitignore").read_text().split()


# -- the real image: needs a Docker engine -----------------------------------------------------


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("docker") is None:
        pytest.skip("no docker client on PATH")
    try:
        info = docker("info", timeout=60)
    except subprocess.TimeoutExpired:
        pytest.skip("`docker info` timed out: no Docker engine answers")
    if info.returncode != 0:
        pytest.skip(f"no Docker engine answers `docker info`: {info.stderr.strip()[-300:]}")
    if docker("image", "inspect", BASE_IMAGE).returncode != 0:
        if not BASE_IMAGE.startswith("local/"):
            docker("pull", BASE_IMAGE, timeout=900)
        if docker("image", "inspect", BASE_IMAGE).returncode != 0:
            pytest.skip(
                f"base image {BASE_IMAGE} is missing: make it with docker-local-base.sh "
                "(e.g. `bash /work/shared/tools/docker-local-base.sh`, a debootstrap of "
                "Debian bookworm + `docker import`), or point FASTLOAD_DOCKER_BASE at an "
                "image you can pull, e.g. python:3.11-slim-bookworm"
            )
    # Behind a TLS-inspecting proxy pip needs its CA: put the host's extra certificates into
    # the build context (docker/certs/ is git-ignored apart from its README).
    for crt in sorted(HOST_CERTS.glob("*.crt")) if HOST_CERTS.is_dir() else []:
        shutil.copy2(crt, CERTS / crt.name)
    build = docker(
        "build", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "-t", TAG, str(REPO), timeout=3600
    )
    assert build.returncode == 0, (build.stdout + build.stderr)[-6000:]
    return TAG


@pytest.mark.docker
def test_image_prints_the_full_config(image):
    out = docker("run", "--rm", image, "python", "train.py", "--cfg", "job", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for group in CONFIG_GROUPS:
        assert re.search(rf"^{group}:", out.stdout, re.M), f"{group} missing:\n{out.stdout}"


@pytest.mark.docker
def test_image_trusts_the_build_context_certificates(image):
    out = docker("run", "--rm", image, "ls", "/usr/local/share/ca-certificates/extra")
    assert out.returncode == 0, out.stderr
    for crt in CERTS.glob("*.crt"):
        assert crt.name in out.stdout.split(), out.stdout


@pytest.mark.docker
def test_image_trains_a_tiny_run_on_cpu(image):
    out = docker(
        "run", "--rm", "--shm-size=1g", image,
        "python", "train.py", "debug=fast", "trainer.epochs=1",
        timeout=1200,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    assert "best top-1" in out.stdout, text[-6000:]
    assert "/app/outputs/" in out.stdout, out.stdout  # output_root is relative to WORKDIR /app
    assert "Traceback" not in text, text[-6000:]
