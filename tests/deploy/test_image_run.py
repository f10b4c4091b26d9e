"""The images built and run: what a cluster pulls, proven end to end (slow; root + podman).

Images are built with podman from a local Debian bookworm base (scripts/build_base_image.sh: no
registry is reachable here), then run as their configs say (image_runner.py: entrypoint, user,
working directory, environment; under chroot since containers cannot start here).

By default (`make test`) the controller image is built and serves a greedy completion, in front
of an executor from the source tree, that must equal the source tree's own. With
TANDEM_IMAGE_TESTS=all the GPU executor image is built too and serves that completion behind
the built controller (torch on the CPU: no GPU here). It is left out of the default run because
PyPI's torch is the CUDA build: the image holds 7.6 GB and takes ~30 minutes to build cold on
two cores, more than the suite's budget. What this cannot prove without a GPU: CUDA itself, and
Triton compiling a kernel (the full run checks that the compiler and headers Triton's launcher
build needs are in the image, and that they compile and link a Python extension). The TPU image
is not built here; `make images` builds it.
"""

from __future__ import annotations

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

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MAX_TOKENS = 12
# The images built: the controller's always; the GPU executor's with TANDEM_IMAGE_TESTS=all.
FULL = os.environ.get("TANDEM_IMAGE_TESTS", "") == "all"
IMAGES = ["controller", "executor-gpu"] if FULL else ["controller"]
needs_executor_image = pytest.mark.skipif(
    not FULL, reason="the GPU executor image is built with TANDEM_IMAGE_TESTS=all"
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The base and IMAGES (podman's layer cache makes repeats fast); the seconds each build
    took, printed for the report."""
    why = image_runner.podman_usable(IMAGES)
    if why:
        pytest.skip(why)
    log = str(tmp_path_factory.mktemp("images") / "build.log")
    times = {"base": image_runner.build_base(log)}
    for image in IMAGES:
        try:
            times[image] = image_runner.build(image, log)
        except subprocess.CalledProcessError:
            with open(log) as f:
                pytest.fail(f"building {image} failed:\n{f.read()[-6000:]}")
    print(f"\nimage build seconds: { {k: round(v, 1) for k, v in times.items()} }")
    return times


def _start_executor(logs: str, grpc_port: int):
    """The executor: from its built image (FULL), else from the source tree; (process, its
    ChrootContainer or None)."""
    args = ["--host", "127.0.0.1", "--port", str(grpc_port), "--kv-cache-bytes", str(256 * 2**20)]
    if not FULL:
        proc, _ = spawn_executor("executor_gpu", model_dir(), logs, "executor", port=grpc_port)
        return proc, None
    executor = image_runner.ChrootContainer("executor-gpu", model_dir())
    proc = executor.run(
        ["--model", executor.model, *args],
        os.path.join(logs, "executor.log"),
        env={"TANDEM_CPU_KERNELS": "0"},  # the C++ kernels' build: not this test's cost
    )
    return proc, executor


@pytest.fixture(scope="module")
def image_server(built, tmp_path_factory):
    """The built controller (and executor, FULL) running; (URL, executor container or None,
    controller container)."""
    logs = str(tmp_path_factory.mktemp("image-run"))
    controller = image_runner.ChrootContainer("controller", model_dir())
    executor = None
    procs = []
    try:
        grpc_port, http_port = free_port(), free_port()
        proc, executor = _start_executor(logs, grpc_port)
        procs.append(proc)
        procs.append(
            controller.run(
                ["--model", controller.model, "--host", "127.0.0.1", "--port", str(http_port)]
                + ["--executor", f"127.0.0.1:{grpc_port}"],
                os.path.join(logs, "controller.log"),
            )
        )
        url = f"http://127.0.0.1:{http_port}"
        _wait_healthy(url, procs, logs, timeout=600)
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
def test_gpu_image_compiles_what_triton_needs(image_server, tmp_path):
    """Triton builds its CUDA launcher as a Python extension with the system C compiler at the
    first kernel launch: the image compiles and loads one the same way (gcc, libc and Python
    headers), as the image's user."""
    _, executor, _ = image_server
    src = executor.root + "/tmp/probe.c"
    with open(src, "w") as f:
        f.write(
            "#include <Python.h>\n"
            'static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "probe", NULL, -1, NULL};\n'
            "PyMODINIT_FUNC PyInit_probe(void) { return PyModule_Create(&m); }\n"
        )
    script = (
        "import sysconfig, subprocess;"
        "inc = sysconfig.get_paths()['include'];"
        "subprocess.run(['gcc', '-shared', '-fPIC', '-O2', '-I', inc, '/tmp/probe.c',"
        " '-o', '/tmp/probe' + sysconfig.get_config_var('EXT_SUFFIX')], check=True);"
        "import sys; sys.path.insert(0, '/tmp'); import probe; print('ok', probe.__name__)"
    )
    cmd = ["chroot", f"--userspec={executor.config.user}", executor.root]
    cmd += ["/usr/bin/env", "-i", "-C", "/tmp"]  # env's options come before the variables
    cmd += [f"{k}={v}" for k, v in executor.config.env.items()]
    cmd += ["python", "-c", script]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok probe" in out.stdout, out.stderr


def test_image_sizes_are_reported(image_server):
    """Each image's size and what dominates it, printed for the report (never asserted as a
    speed or size bound beyond sanity: the controller image holds no torch)."""
    _, executor, controller = image_server
    venv = "/opt/venv/lib/python3.11/site-packages"
    for c in [c for c in (controller, executor) if c is not None]:
        parts = {p: c.du(f"{venv}/{p}") for p in ("torch", "nvidia", "triton", "llguidance")}
        parts.update({"/usr": c.du("/usr"), "/opt/venv": c.du("/opt/venv")})
        print(
            f"\n{c.image}: {c.config.size / 2**20:.0f} MiB;",
            {k: f"{v / 2**20:.0f} MiB" for k, v in parts.items()},
        )
    assert controller.config.size < 600 * 2**20


def _exists(c: image_runner.ChrootContainer, path: str) -> bool:
    return os.path.exists(c.root + path)
