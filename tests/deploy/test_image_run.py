"""The images built and run: what a cluster pulls, proven end to end (slow; root + podman).

Images are built with podman from a local Debian bookworm base (scripts/build_base_image.sh: no
registry is reachable here), then run as their configs say (image_runner.py: entrypoint, user,
working directory, environment; under chroot since containers cannot start here).

By default (`make test`) the controller image, the executor image and the TPU image are built.
The executor image serves, behind the controller image, a greedy completion that must equal the
source tree's own. The executor image is docker/executor-gpu.Dockerfile with a CPU build of
torch (TORCH=torch==X+cpu from a wheel that pip's find-links hold on this host, or
TANDEM_TEST_TORCH_INDEX_URL): the GPU image's final stage, without CUDA's ~6 GB.
Without a CPU torch the executor runs from the source tree. The TPU image (PyPI's CUDA torch
2.9.0, torch_xla, libtpu: ~15 minutes cold) runs its executor on XLA:CPU behind the built
controller: it passes warm-up and serves the same greedy completion (TANDEM_IMAGE_TESTS=no-tpu
leaves it out; too little room in podman's store skips it). With TANDEM_IMAGE_TESTS=all the
executor image is built with PyPI's torch, as users pull it (the CUDA build, on the TPU image's
torch layer). What this cannot prove without a GPU: CUDA itself, and Triton compiling a kernel
(checked instead: the image compiles and loads a Python extension with the compiler and headers
Triton's launcher build uses).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time

import httpx
import pytest

from tests.deploy import image_runner
from tests.support.processes import (
    free_port,
    model_dir,
    spawn_executor,
    start_server,
    tail_logs,
)

FULL = os.environ.get("TANDEM_IMAGE_TESTS", "") == "all"
# The TPU image, built by default: PyPI's torch 2.9.0 (the CUDA build: the only torch 2.9.0, which
# torch_xla 2.9.0 needs, reachable here), ~15 minutes cold on two loaded cores and 8 GB kept;
# left out with TANDEM_IMAGE_TESTS=no-tpu, or when podman's store has too little room for it.
TPU = os.environ.get("TANDEM_IMAGE_TESTS", "") != "no-tpu"
# The first test carries the builds (its fixtures): ~25 minutes cold on two loaded cores by
# default (the TPU image's 15), ~40 with the CUDA GPU image; pytest's 600 s per test is for one
# test's own work.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400 if FULL else 3600)]

PROMPT = "The capital of France is"
MAX_TOKENS = 12
# The executor image's torch: PyPI's (FULL), else a CPU build found here (None: not built).
CPU_TORCH = None if FULL else image_runner.find_cpu_torch()
EXECUTOR_IMAGE = FULL or CPU_TORCH is not None
# The images built, with their extra build arguments.
BUILDS = {"controller": []}
if EXECUTOR_IMAGE:
    BUILDS["executor-gpu"] = CPU_TORCH.build_args() if CPU_TORCH else []
if TPU:  # PyPI's torch 2.9.0 (what torch_xla needs): with FULL, the GPU image's torch layer
    BUILDS["executor-tpu"] = []
# Why an image asked for was not built (too little room in podman's store).
SKIPPED: dict[str, str] = {}
needs_executor_image = pytest.mark.skipif(
    not EXECUTOR_IMAGE,
    reason="no CPU torch wheel here (pip's find-links, TANDEM_TEST_WHEELS or "
    "TANDEM_TEST_TORCH_INDEX_URL); TANDEM_IMAGE_TESTS=all builds the CUDA one",
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The base and BUILDS (podman's layer cache makes repeats fast); the seconds each build
    took, printed for the report."""
    builds = dict(BUILDS)
    why = image_runner.podman_usable([i for i in builds if i != "executor-tpu"], full=FULL)
    if why:
        pytest.skip(why)
    if TPU:
        SKIPPED["executor-tpu"] = image_runner.podman_usable(["executor-tpu"])
        if SKIPPED["executor-tpu"]:  # the other images still build and run
            del builds["executor-tpu"]
    log = str(tmp_path_factory.mktemp("images") / "build.log")
    times = {"base": image_runner.build_base(log)}
    for image, args in builds.items():
        try:
            times[image] = image_runner.build(image, log, args)
        except subprocess.CalledProcessError:
            with open(log) as f:
                pytest.fail(f"building {image} failed:\n{f.read()[-6000:]}")
    print(f"\nimage build seconds: { {k: round(v, 1) for k, v in times.items()} }")
    return times


def _start_executor(logs: str, grpc_port: int):
    """The executor: from its built image (EXECUTOR_IMAGE), else from the source tree;
    (process, its ChrootContainer or None)."""
    args = ["--host", "127.0.0.1", "--port", str(grpc_port), "--kv-cache-bytes", str(256 * 2**20)]
    if not EXECUTOR_IMAGE:
        proc, _ = spawn_executor("executor_gpu", model_dir(), logs, "executor", port=grpc_port)
        return proc, None
    executor = image_runner.ChrootContainer("executor-gpu", model_dir())
    proc = executor.run(
        ["--model", executor.model, *args],
        os.path.join(logs, "executor.log"),
        env={"TANDEM_CPU_KERNELS": "0"},  # the source tree's reference runs the torch path too
    )
    return proc, executor


@pytest.fixture(scope="module")
def image_server(built, tmp_path_factory):
    """The built controller (and executor, EXECUTOR_IMAGE) running; (URL, executor container
    or None, controller container)."""
    logs = str(tmp_path_factory.mktemp("image-run"))
    with _serving(logs, _start_executor) as (url, executor, controller):
        yield url, executor, controller


@contextlib.contextmanager
def _serving(logs: str, start_executor, controller_args: list[str] = ()):
    """The built controller (with controller_args) in front of start_executor(logs,
    grpc_port)'s executor, healthy; (URL, executor container or None, controller container);
    everything stopped after."""
    controller = image_runner.ChrootContainer("controller", model_dir())
    executor = None
    procs = []
    try:
        grpc_port, http_port = free_port(), free_port()
        proc, executor = start_executor(logs, grpc_port)
        procs.append(proc)
        procs.append(
            controller.run(
                ["--model", controller.model, "--host", "127.0.0.1", "--port", str(http_port)]
                + ["--executor", f"127.0.0.1:{grpc_port}", *controller_args],
                os.path.join(logs, "controller.log"),
            )
        )
        url = f"http://127.0.0.1:{http_port}"
        _wait_healthy(url, procs, logs, timeout=900)
        yield url, executor, controller
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        if executor is not None:
            executor.close()
        controller.close()


def _wait_healthy(url: str, procs, logs: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"an image's process exited:\n{tail_logs(logs)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"the images' server was not healthy in {timeout}s:\n{tail_logs(logs)}")


def _complete(url: str, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_images_serve_the_source_trees_greedy_completion(image_server, tmp_path):
    url, _, controller = image_server
    name = os.path.basename(controller.model)
    from_images = _complete(url, name)
    source = start_server(model_dir(), str(tmp_path))
    try:
        from_source = _complete(source.base_url, name)
    finally:
        source.stop()
    assert from_images and from_images == from_source


def test_images_run_as_their_configs_say(image_server):
    _, executor, controller = image_server
    built = [c for c in (executor, controller) if c is not None]
    for c in built:
        assert c.config.user == "10001:10001" and c.config.workdir == "/opt/tandem"
        assert c.config.entrypoint[:2] == ["python", "-m"]
        assert c.config.env["PATH"].startswith("/opt/venv/bin:")
        # Build tools stay in the build stage.
        assert not _exists(c, "/opt/venv/lib/python3.11/site-packages/grpc_tools")
        assert not _exists(c, "/src")
    assert controller.config.exposed == ["8000/tcp"]
    # The controller image carries no torch; the executor's does.
    assert not _exists(controller, "/opt/venv/lib/python3.11/site-packages/torch")
    if executor is not None:
        assert executor.config.exposed == ["50051/tcp"]
        assert _exists(executor, "/opt/venv/lib/python3.11/site-packages/torch")


@needs_executor_image
def test_gpu_image_compiles_what_triton_needs(image_server):
    """Triton builds its CUDA launcher as a Python extension with the system C compiler at the
    first kernel launch: the image compiles and loads one the same way (gcc, libc and Python
    headers), as the image's user. The runtime stage is the same whichever torch the image has."""
    _, executor, _ = image_server
    _write(executor, "/tmp/probe.c", PYTHON_EXTENSION)
    script = (
        "import sysconfig, subprocess;"
        "inc = sysconfig.get_paths()['include'];"
        "subprocess.run(['gcc', '-shared', '-fPIC', '-O2', '-I', inc, '/tmp/probe.c',"
        " '-o', '/tmp/probe' + sysconfig.get_config_var('EXT_SUFFIX')], check=True);"
        "import sys; sys.path.insert(0, '/tmp'); import probe; print('ok', probe.__name__)"
    )
    out = _run_as_image_user(executor, ["python", "-c", script])
    assert out.returncode == 0 and "ok probe" in out.stdout, out.stderr


PYTHON_EXTENSION = (
    "#include <Python.h>\n"
    'static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "probe", NULL, -1, NULL};\n'
    "PyMODINIT_FUNC PyInit_probe(void) { return PyModule_Create(&m); }\n"
)
# What executor_gpu/cpu's build compiles with (OpenMP, this CPU's instructions), in C++.
OPENMP_CXX = (
    "#include <omp.h>\n#include <vector>\n"
    'extern "C" int probe() { std::vector<int> v(64, 1); int s = 0;\n'
    "#pragma omp parallel for reduction(+:s)\n"
    "for (int i = 0; i < 64; ++i) s += v[i]; return s; }\n"
)


@needs_executor_image
def test_executor_image_has_what_the_cpu_kernels_build_needs(image_server):
    """On a CPU node the executor compiles its C++ kernels at first use, for that node's CPU
    (-march=native: never at build time), with torch's extension tooling: g++ with OpenMP, the
    venv's ninja and torch's C++ headers, as the image's user. Compiling the kernels themselves
    takes ~6 minutes here (measured once: they build and load in the image), so this checks the
    toolchain with a small C++ OpenMP library built with the kernels' flags."""
    _, executor, _ = image_server
    _write(executor, "/tmp/probe.cpp", OPENMP_CXX)
    site = "/opt/venv/lib/python3.11/site-packages"
    assert _exists(executor, f"{site}/torch/include/torch/extension.h")
    script = (
        "import ctypes, subprocess;"
        "from executor_gpu.cpu import kernels;"
        "flags = kernels._CFLAGS + kernels._LDFLAGS;"
        "subprocess.run(['c++', '-shared', '-fPIC', *flags, '/tmp/probe.cpp', '-o',"
        " '/tmp/probe.so'], check=True);"
        "subprocess.run(['ninja', '--version'], check=True, capture_output=True);"
        "print('ok', ctypes.CDLL('/tmp/probe.so').probe())"
    )
    out = _run_as_image_user(executor, ["python", "-c", script])
    assert out.returncode == 0 and "ok 64" in out.stdout, out.stderr


def _write(c: image_runner.ChrootContainer, path: str, text: str) -> None:
    with open(c.root + path, "w") as f:
        f.write(text)


def _run_as_image_user(c: image_runner.ChrootContainer, argv: list[str]):
    """argv under chroot as the image's user, in /tmp, with exactly the image's environment."""
    cmd = ["chroot", f"--userspec={c.config.user}", c.root]
    cmd += ["/usr/bin/env", "-i", "-C", "/tmp"]  # env's options come before the variables
    cmd += [f"{k}={v}" for k, v in c.config.env.items()]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=120)


# The controller's batch bounds, which set the graphs the TPU executor compiles at warm-up:
# small, as in tests/e2e/test_tpu_e2e.py (its defaults compile 89 graphs, ~20 s each on XLA:CPU
# on two loaded cores: half an hour).
XLA_BOUNDS = ["--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--max-model-len", "256"]


@pytest.mark.skipif(not TPU, reason="TANDEM_IMAGE_TESTS=no-tpu leaves the TPU image out")
def test_tpu_image_warms_up_on_xla_cpu(built, tmp_path):
    """The TPU image's executor on XLA:CPU (PJRT_DEVICE=CPU: no TPU here) behind the built
    controller: it passes warm-up (the controller's cache set-up compiles its graphs) and
    serves the source tree's greedy completion."""
    if "executor-tpu" not in built:
        pytest.skip(SKIPPED.get("executor-tpu") or "the TPU image was not built")

    def start(logs: str, grpc_port: int):
        executor = image_runner.ChrootContainer("executor-tpu", model_dir())
        args = ["--model", executor.model, "--host", "127.0.0.1", "--port", str(grpc_port)]
        args += ["--kv-cache-bytes", str(256 * 2**20)]
        log = os.path.join(logs, "executor.log")
        return executor.run(args, log, env={"PJRT_DEVICE": "CPU"}), executor

    with _serving(str(tmp_path), start, XLA_BOUNDS) as (url, executor, controller):
        assert executor.config.env["PJRT_DEVICE"] == "TPU"  # the image's own; CPU passed here
        from_image = _complete(url, os.path.basename(controller.model))
    (tmp_path / "source").mkdir()
    source = start_server(model_dir(), str(tmp_path / "source"))
    try:
        from_source = _complete(source.base_url, os.path.basename(controller.model))
    finally:
        source.stop()
    assert from_image and from_image == from_source
    with open(tmp_path / "executor.log") as f:
        assert "warm-up" in f.read()


def test_images_hold_their_venv_once_and_no_build_host_setting(built):
    """The executor images install their venv in the final stage: the build stage the store
    keeps beside an image (<image>:test-build) holds no venv of the image's (it once held the
    whole venv, torch's GBs, copied again into the final stage: ~3x the image's size on the
    builder's disk at its peak). No history entry of either names a build-host path (this
    checkout, the wheel folder) or a pip setting: those come as the pip.conf secret."""
    wheels = CPU_TORCH.wheels if CPU_TORCH and CPU_TORCH.wheels else None
    pip = ["PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CERT", "PIP_FIND_LINKS", "src="]
    forbidden = [p for p in (image_runner.ROOT, wheels, *pip) if p]
    base = image_runner.size(image_runner.BASE_IMAGE)
    for image in [i for i in BUILDS if i in built]:
        for tag in (image_runner.ref(image), image_runner.ref(image) + "-build"):
            for _, created_by in image_runner.history(tag):
                found = [p for p in forbidden if p in created_by]
                assert not found, f"{tag}: {found} in its history: {created_by[:200]}"
        if image.startswith("executor-"):
            build_stage = image_runner.size(image_runner.ref(image) + "-build") - base
            assert build_stage < 200 * 2**20, f"{image}'s build stage holds {build_stage} bytes"
            final = image_runner.history(image_runner.ref(image))
            assert not any(c.startswith("|") for _, c in final), "build arguments in the image"
            torch_layers = [n for n, c in final if "-r /tmp/build/torch.txt" in c]
            assert len(torch_layers) == 1 and torch_layers[0] > 100 * 2**20


def test_image_sizes_are_reported(image_server):
    """Each image's size and what dominates it, printed for the report (never asserted as a
    speed or size bound beyond sanity: the controller image holds no torch)."""
    _, executor, controller = image_server
    venv = "/opt/venv/lib/python3.11/site-packages"
    for c in [c for c in (controller, executor) if c is not None]:
        names = ("torch", "nvidia", "triton", "sympy", "llguidance")
        parts = {p: c.du(f"{venv}/{p}") for p in names}
        parts.update({p: c.du(p) for p in ("/usr", "/usr/lib/gcc", "/opt/venv")})
        print(
            f"\n{c.image}: {c.config.size / 2**20:.0f} MiB;",
            {k: f"{v / 2**20:.0f} MiB" for k, v in parts.items()},
        )
    assert controller.config.size < 600 * 2**20
    if CPU_TORCH is not None:  # a CPU torch brings none of CUDA's libraries
        assert not _exists(executor, f"{venv}/nvidia") and executor.config.size < 2.5 * 2**30


def _exists(c: image_runner.ChrootContainer, path: str) -> bool:
    return os.path.exists(c.root + path)
