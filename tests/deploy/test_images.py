"""The container images (docker/*.Dockerfile): parsed and checked, since no Docker engine runs here.

Each image: pinned base images, a numeric non-root USER that the chart's securityContext
matches, exec-form ENTRYPOINT of its service, the port the chart's values use, exactly its
pyproject extra (the controller's: `controller`, so no torch), stubs generated at build time, and
a per-Dockerfile .dockerignore that lets in only what the image needs. `make images` builds the
tags the chart's values point at. The GPU image carries the C compiler Triton needs at run time.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.deploy.dockerfiles import (
    DOCKER,
    apt_installs,
    dockerfile,
    dockerignore,
    dockerignore_admits,
    parse_dockerfile,
    pip_requirements,
)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tandem"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())

# image name -> (python module it runs, its pyproject extra, the chart's values section)
IMAGES = {
    "controller": ("controller", "controller", "controller"),
    "executor-gpu": ("executor_gpu", "gpu", "gpu"),
    "executor-tpu": ("executor_tpu", "tpu", "tpu"),
}
PACKAGES = {"common", "controller", "executor_gpu", "executor_tpu"}


# --- tests -------------------------------------------------------------------------------------


def test_parser_reads_stages_and_continuations():
    stages = parse_dockerfile(
        "# syntax=docker/dockerfile:1\nFROM a:1.2.3 AS build\nRUN pip install \\\n"
        "    # a comment inside\n    x 'y[z]==1' && echo\nFROM a:1.2.3\nUSER 1:1\n"
    )
    assert [(s.base, s.name) for s in stages] == [("a:1.2.3", "build"), ("a:1.2.3", None)]
    assert pip_requirements(stages) == ["x", "y[z]==1"]
    assert stages[1].all("USER") == ["1:1"]
    assert dockerignore_admits(["*", "!src/"], "src/a.py")
    assert not dockerignore_admits(["*", "!src/", "**/__pycache__"], "src/__pycache__/a.pyc")
    assert not dockerignore_admits(["*", "!src/"], "tests/a.py")
    # The base image as a build argument: FROM resolves it to its default.
    stages = parse_dockerfile(
        "ARG BASE=a:1.2.3\nFROM ${BASE} AS build\nRUN pip install ${X:+-x} .\n"
    )
    assert stages[0].base == "a:1.2.3" and pip_requirements(stages) == ["."]


def test_every_image_has_a_dockerfile():
    assert sorted(p.name for p in DOCKER.glob("*.Dockerfile")) == sorted(
        f"{i}.Dockerfile" for i in IMAGES
    )


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_base_images_are_pinned(image):
    stages = dockerfile(image)
    names = set()
    for stage in stages:
        if stage.base in names:
            continue  # an earlier stage of this file
        m = re.fullmatch(r"([a-z0-9./_-]+):([\w.-]+)(@sha256:[0-9a-f]{64})?", stage.base)
        assert m, f"{image}: base image {stage.base!r} has no tag"
        tag = m.group(2)
        # A full version (x.y.z), never latest nor a moving major/minor tag.
        assert re.match(r"\d+\.\d+\.\d+", tag), f"{image}: {stage.base} is not pinned"
        if stage.name:
            names.add(stage.name)
    assert len(stages) >= 2, f"{image}: build tools stay out of a multi-stage build's last stage"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_runs_as_non_root_with_the_chart_uid(image):
    final = dockerfile(image)[-1]
    users = final.all("USER")
    assert users, f"{image}: the last stage sets no USER (would run as root)"
    user = users[-1]
    # Numeric, so that Kubernetes' runAsNonRoot can verify it without /etc/passwd.
    m = re.fullmatch(r"(\d+)(?::(\d+))?", user)
    assert m, f"{image}: USER {user!r} is not numeric"
    uid = int(m.group(1))
    assert uid != 0 and int(m.group(2) or 1) != 0
    assert any(f"--uid {uid}" in run for run in final.all("RUN")), "the user is created"
    module, extra, section = IMAGES[image]
    pod = VALUES[section]["podSecurityContext"]
    if pod.get("runAsNonRoot"):
        assert pod["runAsUser"] == uid and pod["runAsGroup"] == int(m.group(2))
    else:
        # The TPU pool runs as root on purpose (root-owned device nodes): documented in values.
        assert image == "executor-tpu" and VALUES[section]["securityContext"]["runAsUser"] == 0


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_entrypoint_and_port_match_the_chart(image):
    module, _, section = IMAGES[image]
    final = dockerfile(image)[-1]
    (entrypoint,) = final.all("ENTRYPOINT")
    assert json.loads(entrypoint) == ["python", "-m", module]  # exec form: signals reach python
    assert not final.all("CMD")  # the chart passes every argument
    assert final.all("EXPOSE") == [str(VALUES[section]["port"])]
    env = " ".join(final.all("ENV"))
    assert "PATH=/opt/venv/bin:$PATH" in env
    venv = any(rest.startswith("--from=build /opt/venv") for rest in final.all("COPY"))
    assert venv or "python -m venv /opt/venv" in " ".join(final.all("RUN"))


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_installs_exactly_its_extra(image):
    module, extra, _ = IMAGES[image]
    stages = dockerfile(image)
    reqs = pip_requirements(stages)
    local = [r for r in reqs if r.startswith(".")]
    assert extra in PYPROJECT["project"]["optional-dependencies"]
    build = stages[0]
    runs = " ".join(" ".join(build.all("RUN")).split())  # continuation lines joined
    if local != [f".[{extra}]"]:
        # The executor images: the extra's requirements printed from pyproject.toml in the
        # build stage (torch's alone first), installed in the final stage (torch's in its own
        # layer), then the project's wheel without its pins.
        final = " ".join(" ".join(stages[-1].all("RUN")).split())
        printed = f'python pyproject_requirements.py {extra} --torch "$TORCH" >requirements.txt'
        torch = 'python pyproject_requirements.py --only-torch --torch "$TORCH" >torch.txt'
        assert torch in runs and printed in runs, f"{image}: {runs}"
        assert "pip wheel --no-deps -w /wheels ." in runs
        assert "pip install -r /tmp/build/torch.txt" in final
        assert "pip install -r /tmp/build/requirements.txt" in final
        assert "pip install --no-deps /tmp/build/*.whl" in final
        assert "pip check" in final  # what the project needs is all there
    else:
        assert "pip uninstall -y grpcio-tools" in runs
    # The gRPC stubs are generated in the build, as `make proto` does; the tool stays there.
    assert "grpc_tools.protoc -Icommon/wire/pb=proto" in runs and "proto/executor.proto" in runs
    assert "grpcio-tools" not in " ".join(stages[-1].all("RUN"))
    assert any("PIP_NO_CACHE_DIR=1" in e for e in build.all("ENV"))
    copied = {rest.split()[0] for rest in build.all("COPY")}
    wanted = {"common", module}
    assert copied & PACKAGES == wanted, f"{image}: copies packages {copied & PACKAGES}"
    assert {"pyproject.toml", "proto"} <= copied
    for src in set(copied) | {p for rest in build.all("COPY") for p in rest.split()[1:-1]}:
        assert (ROOT / src).exists(), src


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_pip_settings_reach_no_layer_nor_the_history(image):
    """pip's index, mirror, CA bundle and find-links come from the optional `pip.conf` build
    secret on every RUN that runs pip with the network: a secret is in no layer and no history
    entry, where a build argument of the final stage would be written into `podman history`
    (a mirror's credentials, a host path). The final stage takes no build argument at all."""
    stages = dockerfile(image)
    assert not stages[-1].all("ARG"), f"{image}: build arguments in the final stage"
    secret = "--mount=type=secret,id=pip.conf,target=/etc/pip.conf"
    for stage in stages:
        for run in stage.all("RUN"):
            installs = re.findall(r"pip (?:install|wheel) (?!--no-deps /tmp/build)", run)
            if installs:
                assert run.startswith(secret), f"{image}: pip without the secret: {run[:80]}"


@pytest.mark.parametrize("image", ["executor-gpu", "executor-tpu"])
def test_executor_venv_is_written_once(image):
    """torch's venv (GBs) is installed in the final stage, never copied from another: a copy
    stores it twice (the build stage's layer and the copy's), ~3x the image on the builder's
    disk at its peak. The build stage hands over only small files (requirements, the wheel)."""
    stages = dockerfile(image)
    copies = [rest for rest in stages[-1].all("COPY") if rest.startswith("--from=")]
    assert copies and all(
        re.fullmatch(r"--from=build (/src/\S+\.txt|/wheels/)( \S+)* /tmp/build/", c) for c in copies
    ), copies
    assert "python -m venv /opt/venv" in " ".join(stages[-1].all("RUN"))


def test_controller_image_has_no_torch():
    deps = (
        PYPROJECT["project"]["dependencies"]
        + PYPROJECT["project"]["optional-dependencies"]["controller"]
    )
    assert not [d for d in deps if re.match(r"torch", d)], "the controller extra pulls torch"
    text = (DOCKER / "controller.Dockerfile").read_text()
    assert not re.search(r"torch|executor_", text.split("\nFROM", 1)[1])


def test_tpu_image_brings_libtpu_with_the_pinned_torch_xla():
    reqs = pip_requirements(dockerfile("executor-tpu"))
    pins = [
        d for d in PYPROJECT["project"]["optional-dependencies"]["tpu"] if d.startswith("torch_xla")
    ]
    assert pins == ["torch_xla==2.9.0"]
    assert "torch_xla[tpu]==2.9.0" in reqs  # the [tpu] extra is what installs libtpu
    # torch_xla's wheel names no torch: the build imports it, so a torch it was not built
    # against (an undefined symbol) fails the build instead of the pod.
    runs = " ".join(" ".join(dockerfile("executor-tpu")[-1].all("RUN")).split())
    assert 'pip check && python -c "import torch_xla"' in runs, runs
    final = dockerfile("executor-tpu")[-1]
    assert "PJRT_DEVICE=TPU" in " ".join(final.all("ENV"))


def test_gpu_and_tpu_images_share_the_torch_layer():
    """A builder reuses a layer made by the same instruction on the same parent: the executor
    images' final stages agree up to and including torch's install (the copied torch.txt is the
    same file: both build stages print it with the same command), so torch (GBs with CUDA) is
    built and stored once for both."""
    gpu, tpu = (dockerfile(image) for image in ("executor-gpu", "executor-tpu"))
    assert gpu[-1].base == tpu[-1].base
    printed = [
        [c for r in stages[0].all("RUN") for c in r.split("&&") if "torch.txt" in c]
        for stages in (gpu, tpu)
    ]
    assert printed[0] and printed[0] == printed[1]
    final = gpu[-1].instructions
    upto = next(i for i, (ins, rest) in enumerate(final) if "-r /tmp/build/torch.txt" in rest)
    assert upto > 1 and final[: upto + 1] == tpu[-1].instructions[: upto + 1]


def test_gpu_image_asks_for_the_driver():
    env = " ".join(dockerfile("executor-gpu")[-1].all("ENV"))
    assert "NVIDIA_VISIBLE_DEVICES=all" in env
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env


def test_gpu_image_has_the_c_compiler_triton_needs():
    """Triton compiles a C launcher with the system compiler at its first kernel launch: the
    runtime stage installs one (gcc, the C library's headers), lean and without apt's lists."""
    installs = apt_installs(dockerfile("executor-gpu")[-1])
    packages = {p for _, pkgs in installs for p in pkgs}
    assert {"gcc", "libc6-dev"} <= packages, packages
    for run, _ in installs:
        steps = [c.split() for c in re.split(r"&&", run)]
        assert steps[0][:2] == ["apt-get", "update"], run  # in the same layer as the install
        assert all("--no-install-recommends" in s for s in steps if s[:2] == ["apt-get", "install"])
        assert steps[-1] == ["rm", "-rf", "/var/lib/apt/lists/*"], run  # no package lists kept


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_build_context_is_only_what_the_image_needs(image):
    module, _, _ = IMAGES[image]
    patterns = dockerignore(image)
    admitted = lambda p: dockerignore_admits(patterns, p)  # noqa: E731
    for path in (
        "pyproject.toml",
        "proto/executor.proto",
        "common/wire/config.py",
        "common/wire/pb/__init__.py",
        f"{module}/__init__.py",
    ):
        assert admitted(path), f"{image}: {path} is left out of the build context"
    for rest in dockerfile(image)[0].all("COPY"):  # every file the build stage copies
        for src in rest.split()[:-1]:
            if (ROOT / src).is_file():
                assert admitted(src), f"{image}: {src} is copied but left out of the context"
    others = PACKAGES - {"common", module}
    for path in [f"{p}/__init__.py" for p in others] + [
        ".venv/bin/python",
        ".git/HEAD",
        "tests/deploy/test_chart.py",
        "charts/tandem/values.yaml",
        "common/wire/pb/executor_pb2.py",
        "common/wire/pb/executor_pb2_grpc.py",
        f"{module}/__pycache__/x.cpython-311.pyc",
        "README.md",
    ]:
        assert not admitted(path), f"{image}: {path} gets into the build context"


def test_image_tags_follow_the_release():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == PYPROJECT["project"]["version"]  # the default image tag


def test_make_images_builds_what_the_chart_runs():
    if not shutil.which("make"):
        pytest.skip("make is not installed")
    out = subprocess.run(
        ["make", "-n", "images", "IMAGE_TAG=9.9.9", "IMAGE_REGISTRY=reg.io/x/"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for image, (_, _, section) in IMAGES.items():
        repository = VALUES[section]["image"]["repository"]
        assert re.search(
            rf"(docker|podman) build -f docker/{image}\.Dockerfile -t reg\.io/x/"
            rf"{re.escape(repository)}:9\.9\.9 [^\n]*\.$",
            out.replace("\\\n", " "),
            re.M,
        ), out
