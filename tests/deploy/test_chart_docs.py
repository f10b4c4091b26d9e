"""The chart's documentation and schema stay in step with values.yaml: the README is generated
from values.yaml's comments (scripts/chart_readme.py), and values.schema.json lists exactly the
keys values.yaml has wherever it describes an object field by field."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from tests.deploy.chart_render import CHART, ROOT

# Kubernetes Probe objects: the schema lists the optional Probe fields a user may add.
PROBES = {"startupProbe", "readinessProbe", "livenessProbe"}


def test_readme_is_generated_from_values():
    out = subprocess.run(
        [sys.executable, "scripts/chart_readme.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr


def test_readme_lists_every_value():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import chart_readme
    finally:
        sys.path.pop(0)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    _, found = chart_readme.entries((CHART / "values.yaml").read_text())
    paths = {e.path for e in found}

    def every(v, prefix=""):
        for k, x in v.items():
            yield prefix + k
            if isinstance(x, dict):
                yield from every(x, prefix + k + ".")

    assert set(every(values)) == paths


def _mismatches(schema: dict, values: object, path: str) -> list[str]:
    if not isinstance(values, dict) or "properties" not in schema:
        return []  # a scalar, or an object the schema leaves open (resources, affinity...)
    props = schema["properties"]
    found = []
    if schema.get("additionalProperties") is False and path.rsplit(".", 1)[-1] not in PROBES:
        found += [
            f"{path}.{k}: in the schema, not in values.yaml" for k in set(props) - set(values)
        ]
    found += [f"{path}.{k}: in values.yaml, not in the schema" for k in set(values) - set(props)]
    for key, sub in props.items():
        if key in values:
            found += _mismatches(sub, values[key], f"{path}.{key}")
    return found


def test_schema_is_in_step_with_values():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert _mismatches(schema, values, "") == []
    # The check itself: a value without a schema entry, and the reverse, are found.
    values["tests"]["extra"] = 1
    del values["tests"]["maxTokens"]
    assert sorted(_mismatches(schema, values, "")) == [
        ".tests.extra: in values.yaml, not in the schema",
        ".tests.maxTokens: in the schema, not in values.yaml",
    ]
