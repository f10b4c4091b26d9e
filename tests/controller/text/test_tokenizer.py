"""Tests of controller.text.tokenizer against the reference tokenizer of the default model."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from controller.text.tokenizer import ChatTemplateError, Tokenizer

MODEL_DIR = Path(
    os.environ.get("TANDEM_MODEL_DIR", "/root/.cache/tandem/models/SmolLM2-135M-Instruct")
).expanduser()
if not (MODEL_DIR / "tokenizer.json").is_file():
    pytest.skip(f"model directory {MODEL_DIR} not found", allow_module_level=True)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def ref():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR))


def _ref_chat(ref, messages, **kwargs) -> str:
    return ref.apply_chat_template(messages, tokenize=False, **kwargs)


def _ref_chat_ids(ref, messages, **kwargs) -> list[int]:
    out = ref.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _model_dir(tmp_path: Path, tokenizer_config: dict | None = None, **files: object) -> Path:
    """A model directory with the default model's tokenizer.json and the given JSON/text files."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "tokenizer.json").symlink_to(MODEL_DIR / "tokenizer.json")
    if tokenizer_config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, content in files.items():
        path = tmp_path / name.replace("__", ".")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return tmp_path


TEXTS = [
    "Hello, world!",
    " leading space and trailing space ",
    "Ünïcödé: 你好\uff0c世界 — emoji 🎉👩‍👩‍👧 and tabs\tand\nnewlines\n\n",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
    "",
]


def test_properties_match_reference(tok: Tokenizer, ref) -> None:
    assert tok.vocab_size == len(ref)
    assert tok.bos_token_id == ref.bos_token_id == 1
    assert ref.eos_token_id in tok.eos_token_ids
    assert tok.eos_token_ids == [2]
    assert tok.eos_token_id == 2
    assert set(ref.all_special_ids) <= set(tok.all_special_ids)
    assert tok.special_tokens["eos_token"] == ref.eos_token
    assert tok.has_chat_template and tok.chat_template == ref.chat_template
    assert tok.clean_up_tokenization_spaces is False


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_reference(tok: Tokenizer, ref, text: str, add_special_tokens: bool) -> None:
    assert tok.encode(text, add_special_tokens=add_special_tokens) == ref.encode(
        text, add_special_tokens=add_special_tokens
    )


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_reference(tok: Tokenizer, ref, skip_special_tokens: bool) -> None:
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 40))]
        ids += [rng.randrange(20) for _ in range(rng.randint(0, 3))]  # some special tokens
        rng.shuffle(ids)
        assert tok.decode(ids, skip_special_tokens) == ref.decode(
            ids, skip_special_tokens=skip_special_tokens
        )
    for text in TEXTS:
        ids = ref.encode(text)
        assert tok.decode(ids, skip_special_tokens) == ref.decode(
            ids, skip_special_tokens=skip_special_tokens
        )


def test_token_conversions(tok: Tokenizer, ref) -> None:
    ids = [*list(range(0, tok.vocab_size, 997)), 1, 2]
    assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.id_to_token(10**7) is None


CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is the capital of France?"}],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    "multi_turn": [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Arr, ahoy there."},
        {"role": "user", "content": "Where's the treasure? 🏴‍☠️ 宝"},
    ],
    "multi_turn_no_system": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  and 3+3?\n"},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_reference(
    tok: Tokenizer, ref, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    expected = _ref_chat(ref, messages, add_generation_prompt=add_generation_prompt)
    assert (
        tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    )
    ids = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == _ref_chat_ids(ref, messages, add_generation_prompt=add_generation_prompt)
    assert ids.count(tok.bos_token_id) == sum(1 for _ in expected.split("<|im_start|>")) - 1


def test_default_generation_prompt_is_on(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(CONVERSATIONS["user_only"]).endswith("<|im_start|>assistant\n")


def test_content_parts_are_joined(tok: Tokenizer) -> None:
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
        }
    ]
    plain = [{"role": "user", "content": "one\ntwo"}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(plain)
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
        )


def test_messages_are_not_modified(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}], "name": None}]
    before = json.dumps(messages)
    tok.apply_chat_template(messages)
    assert json.dumps(messages) == before


FEATURE_TEMPLATE = """\
{{ bos_token }}{% set ns = namespace(n=0, first='') %}
{% if tools %}Tools:
{% for tool in tools %}{{ tool | tojson(indent=2) }}
{{ tool | tojson }}
{% endfor %}{% endif %}
{% for m in messages %}
  {% if m.role == 'system' %}{% set ns.first = m.content %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {% generation %}[{{ ns.n }}]{% endgeneration %} {{ m.role | upper }}: {{ m.content | trim }}
  {%- if m.reasoning_content %} (thought: {{ m.thinking }}){% endif %}
  {% if ns.n >= 3 %}{% break %}{% endif %}
{% endfor %}
system={{ ns.first }} extra={{ extra_flag | default('none') }}{{ eos_token }}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""


def test_template_features_match_reference(tok: Tokenizer, ref) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "météo",
                "description": "<b>weather</b> & co",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "  a  "},
        {"role": "assistant", "content": "b", "reasoning_content": "hmm"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "never shown"},
    ]
    for kwargs in ({}, {"tools": tools, "extra_flag": True}):
        ours = tok.apply_chat_template(messages, chat_template=FEATURE_TEMPLATE, **kwargs)
        theirs = _ref_chat(
            ref, messages, chat_template=FEATURE_TEMPLATE, add_generation_prompt=True, **kwargs
        )
        assert ours == theirs
    assert '"météo"' in ours and "<b>weather</b> & co" in ours and "(thought: hmm)" in ours


def test_raise_exception_is_a_value_error(tok: Tokenizer) -> None:
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}"
        "{% endif %}ok"
    )
    assert (
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template) == "ok"
    )
    with pytest.raises(ValueError, match="first message must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}], chat_template=template)


def test_render_errors_are_value_errors(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError):  # no content: the template adds an undefined value
        tok.apply_chat_template([{"role": "user"}])
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([])
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(["not a dict"])  # type: ignore[list-item]
    with pytest.raises(ChatTemplateError, match="invalid"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% for %}")


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__ }}{{ messages.append(1) }}",
        "{% set ns = namespace() %}{% set ns._secret = 1 %}",
    ],
)
def test_sandbox_blocks_unsafe_templates(tok: Tokenizer, template: str) -> None:
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template)


def test_strftime_now(tok: Tokenizer) -> None:
    out = tok.apply_chat_template(
        [{"role": "user", "content": "x"}], chat_template="{{ strftime_now('%Y') }}"
    )
    assert out.isdigit() and len(out) == 4


def test_no_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    tok = Tokenizer.from_model_dir(_model_dir(tmp_path))
    assert not tok.has_chat_template and tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert tok.decode(tok.encode("still works")) == "still works"
    assert tok.eos_token_ids == [] and tok.bos_token_id is None


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_model_dir(tmp_path)


def test_named_templates_and_token_forms(tmp_path: Path) -> None:
    config = {
        "chat_template": [
            {"name": "default", "template": "D{{ bos_token }}{{ eos_token }}"},
            {"name": "tool_use", "template": "T{{ tools | length }}"},
            {"name": "short", "template": "S"},
        ],
        "bos_token": {"content": "<|im_start|>", "lstrip": False, "__type": "AddedToken"},
        "eos_token": {"content": "<|endoftext|>"},
    }
    path = _model_dir(
        tmp_path,
        config,
        generation_config__json={"eos_token_id": [2, 5]},
        config__json={"eos_token_id": 5, "bos_token_id": 1},
    )
    tok = Tokenizer.from_model_dir(path)
    assert tok.eos_token_ids == [
        2,
        5,
        0,
    ]  # generation config, model config, tokenizer; de-duplicated
    assert tok.bos_token_id == 1
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "D<|im_start|><|endoftext|>"
    assert tok.apply_chat_template(msgs, tools=[{"a": 1}, {"b": 2}]) == "T2"
    assert tok.apply_chat_template(msgs, chat_template="short") == "S"
    assert tok.apply_chat_template(msgs, eos_token="override") == "D<|im_start|>override"


def test_template_file_priority(tmp_path: Path) -> None:
    config = {"chat_template": "from config"}
    only_config = Tokenizer.from_model_dir(_model_dir(tmp_path / "a", config))
    legacy = Tokenizer.from_model_dir(
        _model_dir(tmp_path / "b", config, chat_template__json={"chat_template": "from json"})
    )
    jinja = Tokenizer.from_model_dir(
        _model_dir(
            tmp_path / "c",
            config,
            chat_template__json={"chat_template": "from json"},
            chat_template__jinja="from jinja",
            **{"additional_chat_templates/extra__jinja": "extra one"},
        )
    )
    msgs = [{"role": "user", "content": "x"}]
    assert only_config.apply_chat_template(msgs) == "from config"
    assert legacy.apply_chat_template(msgs) == "from json"
    assert jinja.apply_chat_template(msgs) == "from jinja"
    assert jinja.apply_chat_template(msgs, chat_template="extra") == "extra one"


def test_special_tokens_map_overrides_config(tmp_path: Path) -> None:
    path = _model_dir(
        tmp_path,
        {"eos_token": "<|endoftext|>", "chat_template": "{{ eos_token }}"},
        special_tokens_map__json={"eos_token": {"content": "<|im_end|>"}},
    )
    tok = Tokenizer.from_model_dir(path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_end|>"
    assert tok.eos_token_ids == [2]


def test_cleanup_of_tokenization_spaces_matches_reference(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    words = [
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "hello",
        "world",
        ".",
        "don",
        "'",
        "t",
        "##s",
        "s",
        "!",
        ",",
        "?",
        "n",
        "re",
        "ve",
        "m",
        "a",
        "##b",
    ]
    backend = Backend(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    backend.add_special_tokens(["[CLS]", "[SEP]"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "clean_up_tokenization_spaces": True,
                "cls_token": "[CLS]",
                "sep_token": "[SEP]",
                "unk_token": "[UNK]",
            }
        )
    )
    tok = Tokenizer.from_model_dir(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.clean_up_tokenization_spaces
    rng = random.Random(3)
    for _ in range(300):
        ids = [rng.randrange(len(words)) for _ in range(rng.randint(0, 12))]
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
