"""Rendering the Helm chart (charts/tandem) for the tests, and reading what it rendered.

Rendering uses `helm template` when a helm binary is on PATH, else tests/deploy/helm_render: Go
text/template + sprig (Helm's template engine) with Helm's own functions, built here from
Debian's Go packages (tests/deploy/helm_render/install_deps.sh installs them; `make chart-deps`
too). Rendered objects are validated against the Kubernetes JSON schemas of the oldest and the
newest supported Kubernetes (kubernetes-validate, offline, strict: unknown fields fail).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tandem"
RENDERER_SRC = ROOT / "tests" / "deploy" / "helm_render"
CACHE = Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem")) / "helm-render"
GOPATH = "/usr/share/gocode"
RELEASE, NAMESPACE = "tandem", "llm"
OLDEST_KUBE = "1.27"  # Chart.yaml's kubeVersion floor: native gRPC probes are GA from 1.27

# Objects of these CRDs have no schema in kubernetes-validate: their fields are asserted below.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("keda.sh/v1alpha1", "ScaledObject"),
}


# --- rendering ---------------------------------------------------------------------------------


class RenderError(Exception):
    """The chart refused the values (a `required`, a `fail`, or values.schema.json)."""


def _go_ready() -> bool:
    return bool(shutil.which("go")) and all(
        (Path(GOPATH) / "src/github.com" / p).is_dir() for p in ("Masterminds/sprig", "ghodss/yaml")
    )


def _build_renderer() -> Path:
    """tests/deploy/helm_render built once per source version into the cache folder."""
    digest = hashlib.sha256((RENDERER_SRC / "main.go").read_bytes()).hexdigest()[:16]
    binary = CACHE / f"helm-render-{digest}"
    if binary.exists():
        return binary
    if not _go_ready():
        if not shutil.which("apt-get"):
            pytest.skip(
                "no helm binary, no Go toolchain with sprig, and no apt-get to install "
                "them: the chart cannot be rendered on this machine"
            )
        subprocess.run(["bash", str(RENDERER_SRC / "install_deps.sh")], check=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        GO111MODULE="off",
        GOPATH=GOPATH,
        CGO_ENABLED="0",
        GOCACHE=str(CACHE / "gocache"),
        GOFLAGS="",
    )
    tmp = binary.with_suffix(".tmp")
    subprocess.run(
        ["go", "build", "-o", str(tmp), "."], cwd=RENDERER_SRC, env=env, check=True, timeout=600
    )
    tmp.replace(binary)
    return binary


def _merge(dst: dict, src: dict) -> dict:
    """Helm's merge of user values over the chart's: maps merge, a null deletes the key."""
    for key, value in src.items():
        if value is None:
            dst.pop(key, None)
        elif isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value)
        else:
            dst[key] = value
    return dst


@dataclass
class Renderer:
    helm: str | None
    binary: Path | None

    def _run(
        self,
        chart: Path,
        files: list[Path],
        release: str,
        namespace: str,
        notes: bool,
        lookup: Path | None = None,
    ) -> str:
        if self.helm:
            cmd = [self.helm, "template", release, str(chart), "-n", namespace]
        else:
            # helm validates the merged values against values.schema.json; so do we.
            import jsonschema

            values = yaml.safe_load((chart / "values.yaml").read_text())
            for f in files:
                _merge(values, yaml.safe_load(f.read_text()) or {})
            schema_file = chart / "values.schema.json"
            schema = json.loads(schema_file.read_text()) if schema_file.exists() else {}
            try:
                jsonschema.validate(values, schema)
            except jsonschema.ValidationError as exc:
                where = ".".join(map(str, exc.absolute_path)) or "(root)"
                raise RenderError(f"values don't meet the schema: {where}: {exc.message}") from exc
            cmd = [str(self.binary), "-n", namespace] + (["--notes"] if notes else [])
            cmd += ["--lookup", str(lookup)] if lookup else []
        for f in files:
            cmd += ["-f", str(f)]
        if not self.helm:
            cmd += [release, str(chart)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RenderError(proc.stderr.strip())
        return proc.stdout

    def render(
        self,
        values_file: str | None = None,
        overrides: dict | None = None,
        *,
        tmp_path: Path | None = None,
        release: str = RELEASE,
        namespace: str = NAMESPACE,
        chart: Path = CHART,
        notes: bool = False,
        lookup: list[dict] | None = None,
    ):
        """The chart rendered with a ci/ values file and overrides; `lookup`: the objects
        Helm's lookup finds (the cluster an upgrade meets; `helm template` cannot)."""
        files = []
        if values_file:
            files.append(CHART / "ci" / values_file)
        if overrides:
            assert tmp_path is not None
            extra = tmp_path / f"overrides-{len(list(tmp_path.iterdir()))}.yaml"
            extra.write_text(yaml.safe_dump(overrides))
            files.append(extra)
        cluster = None
        if lookup is not None:
            if self.helm:
                pytest.skip("`helm template` answers lookup with nothing; helm_render can")
            assert tmp_path is not None
            cluster = tmp_path / f"cluster-{len(list(tmp_path.iterdir()))}.yaml"
            cluster.write_text(yaml.safe_dump_all(lookup))
        out = self._run(chart, files, release, namespace, notes, cluster)
        if notes:
            return out
        return Manifest([d for d in yaml.safe_load_all(out) if d])


class Manifest:
    """The rendered objects, looked up by kind and name."""

    def __init__(self, docs: list[dict]):
        self.docs = docs

    def kinds_names(self) -> set[tuple[str, str]]:
        return {(d["kind"], d["metadata"]["name"]) for d in self.docs}

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} objects in {self.kinds_names()}"
        return found[0]

    def all(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]


def container(workload: dict, name: str) -> dict:
    (c,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def flag_values(args: list[str], flag: str) -> list[str]:
    """Every value that follows `flag` in an argument list."""
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def volume(workload: dict, name: str) -> dict:
    (v,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == name]
    return v


def mount(c: dict, name: str) -> dict:
    (m,) = [m for m in c["volumeMounts"] if m["name"] == name]
    return m


def env_of(c: dict) -> dict:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


# --- Kubernetes schema validation --------------------------------------------------------------


CRD_SCHEMAS = Path(__file__).resolve().parent / "crds"


def _closed(schema: dict) -> dict:
    """An openAPIV3Schema as JSON Schema that refuses unknown fields: an object schema with
    properties and no additionalProperties gets additionalProperties false (the API server
    would prune such a field silently: a typo in the chart would vanish unnoticed)."""
    out = {k: v for k, v in schema.items() if k not in ("format", "default")}
    if "properties" in out:
        out["properties"] = {k: _closed(v) for k, v in out["properties"].items()}
        out.setdefault("additionalProperties", False)
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _closed(out["additionalProperties"])
    if "items" in out:
        out["items"] = _closed(out["items"])
    return out


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the JSON schema of each CRD kept in tests/deploy/crds."""
    out = {}
    for f in sorted(CRD_SCHEMAS.glob("*.yaml")):
        crd = yaml.safe_load(f.read_text())
        out[(f"{crd['group']}/{crd['version']}", crd["kind"])] = _closed(crd["openAPIV3Schema"])
    return out


def validate_crd_object(doc: dict) -> None:
    """An object of a CRD whose schema is kept here, validated against it."""
    import jsonschema

    schema = crd_schemas()[(doc["apiVersion"], doc["kind"])]
    try:
        jsonschema.validate(doc, schema)
    except jsonschema.ValidationError as exc:
        where = "/".join(map(str, exc.absolute_path))
        raise AssertionError(
            f"{doc['kind']}/{doc['metadata']['name']} invalid for its CRD: {exc.message} at {where}"
        ) from exc


def validate_k8s(doc: dict) -> None:
    import kubernetes_validate

    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_KINDS:
        return
    if key in crd_schemas():
        validate_crd_object(doc)
        return
    for version in (OLDEST_KUBE, str(kubernetes_validate.latest_version())):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(
                f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version}: "
                f"{exc.message} at {'/'.join(map(str, exc.path))}"
            ) from exc
