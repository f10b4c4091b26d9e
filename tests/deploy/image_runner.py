"""Build the images of docker/ with podman and run them where containers cannot start.

Podman builds as root with chroot isolation (its runtime needs cgroups and setrlimit, refused on
this kind of host). An image runs as its config says, nothing taken from the source tree: a
container is created (never started) and mounted, /proc and /dev are bound into its root file
system and the model copied there, and the image's ENTRYPOINT runs there under `chroot` as the
image's USER, in its WORKDIR, with exactly its ENV (plus what the test passes). The host's
network is shared, so the processes talk over 127.0.0.1 as in one pod.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The local base (scripts/build_base_image.sh); TANDEM_TEST_BASE_IMAGE: another, e.g. a base
# already built on this machine.
BASE_IMAGE = os.environ.get("TANDEM_TEST_BASE_IMAGE", "localhost/tandem-base:bookworm-py3.11-v2")
# Free bytes podman's store needs to build an image from scratch, at its peak: the executor
# image's with PyPI's (CUDA) torch, with a CPU torch, the controller's. Committing a layer
# writes it ~3 more times before the build's copy goes (the container's, a tar in /var/tmp,
# the store's blob, the new layer): PyPI's torch layer, ~7 GB, took 26 GB at its peak.
MIN_FREE_BYTES = {"executor-gpu": 28 * 2**30, "executor-cpu": 6 * 2**30, "controller": 3 * 2**30}
MIN_FREE_BYTES["executor-tpu"] = MIN_FREE_BYTES["executor-gpu"]  # the same torch layer
# Tag of the images the tests build, localhost/tandem/<image>:<TAG>; TANDEM_TEST_IMAGE_TAG:
# another, so that two checkouts building on one host keep apart.
TAG = os.environ.get("TANDEM_TEST_IMAGE_TAG", "test")


def ref(image: str) -> str:
    """The reference of an image the tests build."""
    return f"localhost/tandem/{image}:{TAG}"


def podman_usable(images: list[str], full: bool = True) -> str:
    """Why the image tests cannot build and run `images` here, or "" when they can (full: the
    executor image with PyPI's torch, else with a CPU torch)."""
    if not shutil.which("podman") or not shutil.which("debootstrap"):
        return "podman and debootstrap are not installed (make image-deps)"
    if os.geteuid() != 0:
        return "podman's chroot builds and the chroot runs need root"
    store = "/var/lib/containers/storage"
    free = shutil.disk_usage(store if os.path.exists(store) else "/").free
    sized = [i if full or i != "executor-gpu" else "executor-cpu" for i in images]
    # The TPU image built before (its torch never changes) rebuilds from cached layers.
    cached = {"executor-tpu"} if image_id(ref("executor-tpu")) else set()
    need = max([MIN_FREE_BYTES[s] for s in sized if s not in cached] or [0])
    if free < need:
        return (
            f"{free / 2**30:.0f} GiB free for podman's store; building {', '.join(images)} "
            f"needs {need / 2**30:.0f} GiB"
        )
    return ""


# Where a CPU torch's wheel folder is mounted in a build (pip.conf's find-links names it): a
# fixed path, so that no host path reaches the build's instructions or the image's history.
WHEELS_MOUNT = "/mnt/find-links"


def pip_conf(path: str, find_links: bool = False) -> str:
    """Write the pip.conf the builds get as their `pip.conf` secret (never a layer or the
    history): this host's pip index and CA bundle (file:// indexes left out: the build cannot
    see them), WHEELS_MOUNT as find-links when asked; path returned."""
    lines = ["[global]"]
    for var, key in (("PIP_INDEX_URL", "index-url"), ("PIP_EXTRA_INDEX_URL", "extra-index-url")):
        urls = [u for u in os.environ.get(var, "").split() if not u.startswith("file:")]
        if urls:
            lines.append(f"{key} = {' '.join(urls)}")
    if os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE"):
        # The local base holds the host's extra CAs in Debian's bundle, at the usual path.
        lines.append("cert = /etc/ssl/certs/ca-certificates.crt")
    if find_links:
        lines.append(f"find-links = {WHEELS_MOUNT}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


@dataclass
class CpuTorch:
    """A CPU build of torch the executor image can take instead of PyPI's CUDA build."""

    requirement: str  # pip requirement, e.g. "torch==2.13.0+cpu"
    wheels: str = ""  # folder holding its wheel (mounted into the build), or "" for an index
    index_url: str = ""  # the extra index that serves it (TORCH_INDEX_URL), or ""

    def build_args(self) -> list[str]:
        """podman build arguments (and build-time volume) that install this torch; the wheel
        folder is found through pip.conf's find-links (pip_conf)."""
        if self.index_url:
            return ["--build-arg", f"TORCH_INDEX_URL={self.index_url}"]
        return [
            *("--build-arg", f"TORCH={self.requirement}"),
            *("-v", f"{self.wheels}:{WHEELS_MOUNT}:ro"),
        ]


def find_cpu_torch() -> CpuTorch | None:
    """A CPU torch for this host's Python (cp311) and machine: TANDEM_TEST_TORCH_INDEX_URL (an
    index with a CPU torch meeting the pin, e.g. https://download.pytorch.org/whl/cpu), else a
    torch-*+cpu wheel in a folder pip's find-links name (TANDEM_TEST_WHEELS, PIP_FIND_LINKS or
    pip's config), newest first; None when there is none."""
    index = os.environ.get("TANDEM_TEST_TORCH_INDEX_URL")
    if index:
        return CpuTorch(requirement="", index_url=index)
    folders = os.environ.get("TANDEM_TEST_WHEELS", "").split() or _pip_find_links()
    for folder in folders:
        wheels = sorted(glob.glob(os.path.join(folder, "torch-*+cpu-cp311-cp311-*x86_64.whl")))
        if wheels and os.uname().machine == "x86_64":
            version = os.path.basename(wheels[-1]).split("-")[1]
            return CpuTorch(requirement=f"torch=={version}", wheels=os.path.abspath(folder))
    return None


def _pip_find_links() -> list[str]:
    """Local folders in pip's find-links (environment or configuration)."""
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            links += value.strip("'\"").split()
    return [link for link in dict.fromkeys(links) if os.path.isdir(link)]


def build_base(log_path: str) -> float:
    """The local Debian base (scripts/build_base_image.sh; kept once built); seconds taken."""
    start = time.monotonic()
    with open(log_path, "a") as log:
        subprocess.run(
            ["nice", "-n", "10", "bash", "scripts/build_base_image.sh", BASE_IMAGE],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )
    return time.monotonic() - start


def build(image: str, log_path: str, args: list[str] = (), timeout: float = 1800) -> float:
    """`podman build` of docker/<image>.Dockerfile from BASE_IMAGE as localhost/tandem/<image>
    (cached layers reused), with extra build arguments and pip_conf() as the pip.conf secret;
    seconds taken.

    The build stage is tagged too (<image>:test-build), so that a `podman image prune` leaves
    its cached layers. The images the two tags named before, when replaced, are removed with
    their untagged layers: nothing else (a global prune would also take the intermediate
    images of builds running beside this one)."""
    find_links = f":{WHEELS_MOUNT}:" in " ".join(args)
    secret = pip_conf(os.path.join(os.path.dirname(log_path), "pip.conf"), find_links)
    base = ["nice", "-n", "10", "podman", "build", "--isolation", "chroot"]
    base += ["-f", f"docker/{image}.Dockerfile", "--secret", f"id=pip.conf,src={secret}"]
    base += ["--build-arg", f"BASE_IMAGE={BASE_IMAGE}", *args]
    tags = {"build": f"{ref(image)}-build", "": ref(image)}
    before = {tag: image_id(tag) for tag in tags.values()}
    start = time.monotonic()
    with open(log_path, "a") as log:
        for target, tag in tags.items():
            cmd = [*base, *(["--target", target] if target else []), "-t", tag, "."]
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            subprocess.run(
                cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=timeout
            )
    for tag, old in before.items():
        if old and old != image_id(tag):
            subprocess.run(["podman", "rmi", old], capture_output=True, check=False)
    return time.monotonic() - start


def history(name: str) -> list[tuple[int, str]]:
    """(size in bytes, created-by) of each layer of a local image, newest first."""
    out = subprocess.run(
        ["podman", "history", "--no-trunc", "--format", "json", name],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [(int(h.get("size", 0)), h.get("CreatedBy", "")) for h in json.loads(out)]


def size(name: str) -> int:
    """Bytes of a local image, as podman reports it."""
    out = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Size}}", name],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


def image_id(name: str) -> str:
    """The ID of a local image, "" when there is none."""
    out = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", name], capture_output=True, text=True
    )
    return out.stdout.strip() if out.returncode == 0 else ""


@dataclass
class ImageConfig:
    """What an image's config says about how it runs."""

    entrypoint: list[str]  # ENTRYPOINT (exec form)
    user: str  # USER, "uid:gid"
    workdir: str  # WORKDIR
    env: dict[str, str]  # ENV
    size: int  # bytes, as podman reports it
    exposed: list[str] = field(default_factory=list)  # EXPOSE, "port/proto"


def inspect(image: str) -> ImageConfig:
    out = subprocess.run(
        ["podman", "image", "inspect", ref(image)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    info = json.loads(out)[0]
    config = info["Config"]
    env = dict(e.split("=", 1) for e in config.get("Env", []))
    return ImageConfig(
        entrypoint=config.get("Entrypoint") or [],
        user=config.get("User", ""),
        workdir=config.get("WorkingDir", "/"),
        env=env,
        size=int(info["Size"]),
        exposed=sorted(config.get("ExposedPorts", {})),
    )


class ChrootContainer:
    """A created, mounted container of an image; run() starts its entrypoint under chroot."""

    def __init__(self, image: str, model_dir: str):
        self.image = image
        self.config = inspect(image)
        self.cid = _podman("create", ref(image))
        self.root = _podman("mount", self.cid)
        self.mounts: list[str] = []
        self.model = f"/models/{os.path.basename(model_dir.rstrip('/'))}"
        self._bind("/proc", "/proc", ["-t", "proc", "proc"])
        self._bind("/dev", "/dev", ["--bind", "/dev"], private=True)
        # Copied, owned by the image's user: a bind would keep the host's modes, and the
        # converter writes model.safetensors 0600 for root (a pod gets its files by fsGroup).
        target = self.root + self.model
        shutil.copytree(model_dir, target)
        uid, _, gid = self.config.user.partition(":")
        subprocess.run(["chown", "-R", f"{uid}:{gid or uid}", target], check=True)

    def _bind(self, source: str, target: str, how: list[str], private: bool = False) -> None:
        path = self.root + target
        os.makedirs(path, exist_ok=True)
        subprocess.run(["mount", *how, path], check=True)
        self.mounts.append(path)
        if private:  # nothing mounted below it here reaches the host's tree
            subprocess.run(["mount", "--make-private", path], check=True)

    def run(self, args: list[str], log_path: str, env: dict[str, str] | None = None):
        """The image's ENTRYPOINT + args as its USER, in its WORKDIR, with its ENV (+ env)."""
        c = self.config
        variables = [f"{k}={v}" for k, v in {**c.env, **(env or {})}.items()]
        cmd = ["chroot", f"--userspec={c.user}", self.root]
        cmd += ["/usr/bin/env", "-i", "-C", c.workdir, *variables, *c.entrypoint, *args]
        log = open(log_path, "w")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def du(self, path: str) -> int:
        """Bytes under path in the image's file system."""
        out = subprocess.run(["du", "-sb", self.root + path], capture_output=True, text=True)
        return int(out.stdout.split()[0]) if out.returncode == 0 else 0

    def close(self) -> None:
        for path in reversed(self.mounts):
            subprocess.run(["umount", "-l", path], check=False)
        subprocess.run(["podman", "umount", self.cid], capture_output=True, check=False)
        subprocess.run(["podman", "rm", "-f", self.cid], capture_output=True, check=False)


def _podman(*args: str) -> str:
    out = subprocess.run(["podman", *args], capture_output=True, text=True, check=True)
    return out.stdout.strip()
