"""The controller's tokenizer: text <-> token ids and chat templates, without torch.

Reads a Hugging Face model directory: tokenizer.json (with the `tokenizers` library), the tokenizer
config, chat template files and the generation/model configs (end-of-sequence ids). Chat templates
come with the model, so they are rendered in an immutable Jinja sandbox.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

# Named special tokens a tokenizer config may define; rendered templates see them as variables.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")
SPECIAL_TOKEN_NAMES += ("mask_token",)
# Keys a message's reasoning may arrive under; templates read `reasoning_content` or `thinking`.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The chat template rejected the messages or failed to render; the API answers 400."""


@dataclass
class TokenizerSettings:
    """What a model directory says about its tokenizer beyond tokenizer.json."""

    special_tokens: dict[str, str] = field(default_factory=dict)  # e.g. {"eos_token": "</s>"}
    extra_special_tokens: list[str] = field(default_factory=list)  # unnamed special tokens
    chat_templates: dict[str, str] = field(default_factory=dict)  # name -> Jinja; "default" first
    eos_token_ids: list[int] = field(default_factory=list)  # every id that ends generation
    bos_token_id: int | None = None  # beginning-of-sequence id, if the model has one
    clean_up_tokenization_spaces: bool = False  # remove spaces before punctuation when decoding


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file is absent."""
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token given as a string or as a serialized added token ({"content": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _int_list(value: Any) -> list[int]:
    """An id given as an int or a list of ints, as a list."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _templates_from(value: Any) -> dict[str, str]:
    """Chat templates given as one string or as a list of {"name", "template"} entries."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}
    return {}


def _chat_templates(model_dir: Path, config: dict[str, Any]) -> dict[str, str]:
    """The model's chat templates; separate template files win over tokenizer_config.json."""
    files: dict[str, str] = {}
    if (model_dir / "chat_template.jinja").is_file():
        files["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    for path in sorted(model_dir.glob("additional_chat_templates/*.jinja")):
        files[path.stem] = path.read_text(encoding="utf-8")
    legacy = _read_json(model_dir / "chat_template.json").get("chat_template")
    return files or _templates_from(legacy if legacy is not None else config.get("chat_template"))


def _token_id(backend: BackendTokenizer, settings: TokenizerSettings, name: str) -> int | None:
    """The id of a named special token, if the model defines it and it is in the vocabulary."""
    text = settings.special_tokens.get(name)
    return backend.token_to_id(text) if text is not None else None


def load_settings(model_dir: Path, backend: BackendTokenizer) -> TokenizerSettings:
    """Read the special tokens, chat templates and end-of-sequence ids of a model directory."""
    config = _read_json(model_dir / "tokenizer_config.json")
    special_map = _read_json(model_dir / "special_tokens_map.json")  # overrides the config
    settings = TokenizerSettings(chat_templates=_chat_templates(model_dir, config))
    for name in SPECIAL_TOKEN_NAMES:
        content = _token_content(special_map.get(name)) or _token_content(config.get(name))
        if content is not None:
            settings.special_tokens[name] = content
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = special_map.get(key) or config.get(key) or ()
        extra = extra.values() if isinstance(extra, dict) else extra
        settings.extra_special_tokens += [t for t in map(_token_content, extra) if t is not None]

    model_config = _read_json(model_dir / "config.json")
    text_config = model_config.get("text_config")  # multimodal models nest the language model's
    generation = _read_json(model_dir / "generation_config.json")
    eos = _int_list(generation.get("eos_token_id")) + _int_list(model_config.get("eos_token_id"))
    if isinstance(text_config, dict):
        eos += _int_list(text_config.get("eos_token_id"))
    eos += [i for i in [_token_id(backend, settings, "eos_token")] if i is not None]
    settings.eos_token_ids = list(dict.fromkeys(eos))
    bos = [_token_id(backend, settings, "bos_token"), *_int_list(model_config.get("bos_token_id"))]
    bos += _int_list(generation.get("bos_token_id"))
    settings.bos_token_id = next((i for i in bos if i is not None), None)

    # Cleanup was meant for WordPiece-style vocabularies; it corrupts BPE output, so it is skipped
    # there unless the config insists.
    is_bpe = type(backend.model).__name__ == "BPE"
    forced = config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
    cleanup = bool(config.get("clean_up_tokenization_spaces", False))
    settings.clean_up_tokenization_spaces = cleanup and (not is_bpe or bool(forced))
    return settings


def clean_up_tokenization(text: str) -> str:
    """Remove the spaces a word-piece decoder leaves before punctuation and English contractions."""
    for pattern in _CLEANUP_PATTERNS:
        text = text.replace(pattern, pattern.strip())
    return text


# What `clean_up_tokenization` replaces, in order, by the pattern without its spaces. Every
# pattern starts with a space and is at most 4 characters long (the detokenizer relies on it).
_CLEANUP_PATTERNS = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (a training-time marker): renders the body."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _check_attribute_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace()` for templates that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same calling trick as Jinja's Namespace
        for name in dict(*args[1:], **kwargs):
            _check_attribute_name(name)
        jinja2.utils.Namespace.__init__(*args, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attribute_name(name)
        super().__setitem__(name, value)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
    # Unlike Jinja's own filter, this neither escapes HTML characters nor ASCII-escapes text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox (cached); a syntax error becomes ChatTemplateError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _SafeNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the model's chat template is invalid: {e}") from e


def _message_text(content: Any) -> Any:
    """Message content as text: {"type": "text", "text": ...} parts are joined by newlines."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else part
        if not isinstance(text, str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatTemplateError(f"content part {kind!r} is not supported, only text")
        texts.append(text)
    return "\n".join(texts)


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Copies of the messages as templates expect them: None-valued keys dropped, content as text,
    and reasoning available under both `reasoning_content` and `thinking`."""
    if not messages:
        raise ChatTemplateError("the conversation is empty: give at least one message")
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise ChatTemplateError(f"each message must be an object, got {type(message).__name__}")
        msg = {k: v for k, v in message.items() if v is not None}
        if "content" in msg:
            msg["content"] = _message_text(msg["content"])
        reasoning = next((msg[k] for k in _REASONING_KEYS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


class Tokenizer:
    """A model's tokenizer and chat template, loaded from a local Hugging Face directory."""

    def __init__(self, backend: BackendTokenizer, settings: TokenizerSettings) -> None:
        self.backend = backend
        self.settings = settings
        # Named special tokens that are in the vocabulary count as special: decoding skips them.
        known = backend.get_added_tokens_decoder()
        names = dict.fromkeys([*settings.special_tokens.values(), *settings.extra_special_tokens])
        missing = [
            AddedToken(t, special=True, normalized=False)
            for t in names
            if (i := backend.token_to_id(t)) is not None and not (i in known and known[i].special)
        ]
        if missing:
            backend.add_special_tokens(missing)
        added = backend.get_added_tokens_decoder()
        # Ids `decode(..., skip_special_tokens=True)` drops: added tokens flagged special.
        self.skipped_special_ids = frozenset(i for i, t in added.items() if t.special)
        self._all_special_ids = sorted(self.skipped_special_ids)
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model directory (tokenizer.json is required)."""
        model_dir = Path(path).expanduser()
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} not found: a model directory needs one")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        return cls(backend, load_settings(model_dir, backend))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation: generation config's, model config's, then the tokenizer's."""
        return list(self.settings.eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, if the model has one."""
        return self.settings.bos_token_id

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens, e.g. {"bos_token": "<s>", "eos_token": "</s>"}."""
        return dict(self.settings.special_tokens)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the named special tokens and of every added token flagged special, sorted."""
        return list(self._all_special_ids)

    @property
    def clean_up_tokenization_spaces(self) -> bool:
        """Whether `decode` removes spaces before punctuation (word-piece models ask for it)."""
        return self.settings.clean_up_tokenization_spaces

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id, or None for an unknown id."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id, if any."""
        return self.settings.eos_token_ids[0] if self.settings.eos_token_ids else None

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Vocabulary entries of several ids (None for unknown ids)."""
        to_token = self.backend.id_to_token
        return [to_token(i) for i in ids]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` runs the model's post-processor (BOS...)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids; special tokens are dropped unless `skip_special_tokens` is False."""
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.settings.clean_up_tokenization_spaces:
            text = clean_up_tokenization(text)
        return text

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return bool(self.settings.chat_templates)

    @property
    def chat_template(self) -> str | None:
        """The default chat template's source, if any."""
        return self.settings.chat_templates.get("default")

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """Source of the template to use: a named one, the given source, the tool-use one when
        tools are given and the model has one, else the default."""
        templates = self.settings.chat_templates
        if chat_template is not None:
            return templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        if templates:
            raise ValueError(
                f"the model has several chat templates and none is the default: {sorted(templates)}"
            )
        raise ValueError(
            "this model has no chat template: use the completions endpoint, or give the model "
            "directory a chat_template (tokenizer_config.json or chat_template.jinja)"
        )

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the conversation with the model's chat template into the prompt text.

        Extra keyword arguments become template variables (e.g. `enable_thinking`). Raises
        ChatTemplateError (a ValueError) when the template rejects the messages.
        """
        template = compile_chat_template(self.get_chat_template(chat_template, tools))
        variables: dict[str, Any] = {**self.settings.special_tokens, **kwargs}
        try:
            return template.render(
                messages=normalize_messages(messages),
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template could not render the messages: {e}") from e
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e!r}") from e

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation; the template already wrote the special tokens,
        so none are added again."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        return self.encode(text, add_special_tokens=False)
