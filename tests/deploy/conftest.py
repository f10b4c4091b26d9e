"""Fixtures of the chart tests: the renderer (built once) and the example values rendered."""

from __future__ import annotations

import shutil

import pytest

from tests.deploy.chart_render import CHART, Manifest, Renderer, _build_renderer


@pytest.fixture(scope="session")
def renderer() -> Renderer:
    helm = shutil.which("helm")
    return Renderer(helm=helm, binary=None if helm else _build_renderer())


@pytest.fixture(scope="module")
def rendered(renderer) -> dict[str, Manifest]:
    """Each ci/ values file, rendered."""
    return {p.name: renderer.render(p.name) for p in sorted((CHART / "ci").glob("*.yaml"))}
