"""What a --model value names: a local directory or a Hub id, and its default served name."""

from __future__ import annotations

import pytest

from common.hub.errors import ModelSourceError
from common.hub.reference import default_served_name, parse_reference


def test_existing_directories_and_paths_are_local(tmp_path):
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_reference(str(tmp_path)).is_local
    for text in ("/models/Llama", "./models/x", "~/models/x", "../x"):
        ref = parse_reference(text)
        assert ref.is_local and ref.text == text
    assert parse_reference("~/x").path.startswith("/")


def test_ids_are_hub_references(tmp_path, monkeypatch):
    for text in ("Qwen/Qwen3-8B", "HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "org/a_b.c"):
        ref = parse_reference(text)
        assert not ref.is_local and ref.path == ""
    # A relative directory that exists wins over the id of the same spelling.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_reference("org/name").is_local


@pytest.mark.parametrize("text", ["", "a b", "org/name/extra", "org/..", "-org/x"])
def test_values_that_are_neither_are_refused(text):
    with pytest.raises(ModelSourceError):
        parse_reference(text)


def test_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ModelSourceError, match="is a file"):
        parse_reference(str(tmp_path / "f"))


def test_default_served_name():
    assert default_served_name("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    assert default_served_name("/models/SmolLM2-135M-Instruct/") == "SmolLM2-135M-Instruct"
    assert default_served_name("./x/y") == "y"
