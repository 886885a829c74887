"""Tokenizer (HF ``tokenizers`` tokenizer.json) and chat template (jinja2, as HF renders it)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

from .format import CorruptFileError, MissingFileError, read_json


def _token_str(v: Any) -> str | None:
    """tokenizer_config values are either "<s>" or {"content": "<s>", ...}."""
    if isinstance(v, Mapping):
        return v.get("content")
    return v if isinstance(v, str) else None


class Tokenizer:
    """Encode/decode with a ``tokenizers.Tokenizer`` and render the model's chat template."""

    def __init__(self, tokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 add_bos_token: bool = False):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos_token = add_bos_token

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        """From tokenizer.json (required), tokenizer_config.json and chat_template.jinja
        (optional) in a model directory."""
        from tokenizers import Tokenizer as HFTokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise MissingFileError("tokenizer.json is missing (needed to encode text)", file=path)
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:   # tokenizers raises a bare Exception on malformed files
            raise CorruptFileError(f"cannot load tokenizer: {e}", file=path) from None
        cfg_path = directory / "tokenizer_config.json"
        cfg = read_json(cfg_path) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):     # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja = directory / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        return cls(tok, chat_template=template, bos_token=_token_str(cfg.get("bos_token")),
                   eos_token=_token_str(cfg.get("eos_token")),
                   add_bos_token=bool(cfg.get("add_bos_token", False)))

    # -- ids ----------------------------------------------------------------------------------

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id(self.bos_token)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text`` (special-token strings in it map to their ids); a BOS id is
        prepended when ``add_bos`` (default: tokenizer_config's add_bos_token) and not present."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        add = self.add_bos_token if add_bos is None else add_bos
        bos = self.bos_token_id
        if add and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render the chat template (HF semantics: sandboxed jinja2, trim_blocks, lstrip_blocks,
        ``raise_exception``, ``tojson``, ``strftime_now``)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json "
                             "'chat_template' or chat_template.jinja)")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)


class StreamDecoder:
    """Turns a growing list of token ids into text deltas (holds back incomplete UTF-8)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.text = text[len(self.text):], text
        return delta

    def flush(self) -> str:
        """Whatever is still held back (an incomplete UTF-8 sequence at the very end)."""
        text = self.tokenizer.decode(self.ids)
        delta, self.text = text[len(self.text):], text
        return delta
