"""Tokenizer: text <-> ids over a ``tokenizers.Tokenizer``, chat templates, streaming detokenization.

Three ways in: a Hugging Face folder (``from_hf_folder``), a GGUF file's metadata
(``lockserve.workers.model.gguf_loader.tokenizer_from_gguf``), or the byte-level vocabulary that random-weight
presets use (``byte_level_tokenizer``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Tokenizer:
    """Encode/decode with the model's vocabulary; knows its BOS, its stop ids and its chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        chat_template: str | None = None,
        add_bos_by_default: bool = False,
        source: str = "the model",
    ):
        """``backend`` must not add special tokens itself: BOS is added here when asked for.
        ``eos_token_ids``: the main EOS first (it is the template's ``eos_token``), then other stop ids.
        ``chat_template``: None when the model has none (chats are then refused, never rendered in
        a template the model was not trained on). ``source``: what errors call the model."""
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        self.add_bos_by_default = add_bos_by_default
        self.source = source
        self._template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The main EOS id (None when the vocabulary has none)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end a generation (EOS, end-of-turn)."""
        return frozenset(self.eos_token_ids)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Ids for ``text``. ``add_bos`` None follows the model's own tokenizer (as transformers'
        ``tokenizer(text)`` would); special-token text such as ``<|im_start|>`` maps to its id."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        add = self.add_bos_by_default if add_bos is None else add_bos
        if add and self.bos_token_id is not None:  # even before a BOS in the text, as transformers does
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Render ``messages`` ([{"role", "content"}, ...]) with the model's Jinja chat template.
        ValueError when the model has none: there is no fallback format."""
        if self.chat_template is None:
            raise ValueError(
                f"{self.source} has no chat template (none in tokenizer_config.json, chat_template.jinja, "
                f"chat_template.json or the GGUF's tokenizer.chat_template), so chat messages cannot be "
                f"rendered; send a plain prompt (completions) or add a chat template to the model"
            )
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special_text(self.bos_token_id),
            eos_token=self._special_text(self.eos_token_id),
            **extra,
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Ids of the rendered chat prompt. No extra BOS: templates write their own."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_bos=False)

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        """A streaming decoder for one generation; ``prompt_ids`` give it left context."""
        return IncrementalDetokenizer(self, prompt_ids)

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    @classmethod
    def from_hf_folder(cls, folder: str | Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """From ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``) in ``folder``.
        ``eos_token_ids`` (from config.json / generation_config.json) join the tokenizer's own EOS."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        backend = tokenizers.Tokenizer.from_file(str(path))
        config = _read_json(folder / "tokenizer_config.json")
        bos_id = _token_id(backend, config.get("bos_token"))
        eos_id = _token_id(backend, config.get("eos_token"))
        eos = [*([] if eos_id is None else [eos_id]), *eos_token_ids]
        # As transformers' PreTrainedTokenizerFast: tokenizer.json's post-processor decides whether
        # BOS is added (tokenizer_config's add_bos_token does not override it). The post-processor
        # is then dropped: BOS is ours to add in encode, and never twice.
        add_bos = _post_processor_adds_bos(backend, bos_id)
        backend.post_processor = None
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos,
            chat_template=_chat_template(folder, config),
            add_bos_by_default=bool(add_bos and bos_id is not None),
            source=str(folder),
        )

    def save_hf_folder(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` as transformers reads them."""
        folder = Path(folder)
        backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        if self.add_bos_by_default and self.bos_token_id is not None:
            bos = self._special_text(self.bos_token_id)
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_token_id)]
            )
        backend.save(str(folder / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._special_text(self.bos_token_id) or None,
            "eos_token": self._special_text(self.eos_token_id) or None,
            "add_bos_token": self.add_bos_by_default,
            "chat_template": self.chat_template,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


class IncrementalDetokenizer:
    """Turns a stream of ids into text deltas that never split a UTF-8 character.

    Offset-based (as in vLLM / TGI): text is decoded over a short window of ids ending at the
    newest one, and only the part past what was already emitted is returned — held back while the
    window's text ends in U+FFFD (an incomplete multi-byte character). Concatenating every ``push``
    and the final ``flush`` equals ``decode(all generated ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        # Left context from the prompt keeps spacing right (decoders strip a leading space alone).
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.ids)  # ids before this are already emitted

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ('' while a character is incomplete)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Whatever is held back at the end of the stream (replacement characters included)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


def compile_chat_template(source: str) -> jinja2.Template:
    """A sandboxed Jinja environment configured like transformers' (trim_blocks, lstrip_blocks,
    ``raise_exception``, ``tojson``, ``strftime_now``)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def byte_level_tokenizer(
    special_tokens: Sequence[str] = ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"),
    bos: str = "<|begin_of_text|>",
    eos: Sequence[str] = ("<|end_of_text|>", "<|im_end|>"),
) -> Tokenizer:
    """256 byte tokens (ids 0..255, GPT-2's byte alphabet, no merges) then ``special_tokens``.
    For random-weight presets: any text round-trips, and the ChatML template works."""
    vocab = {char: byte for byte, char in enumerate(BYTE_TO_CHAR)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in special_tokens]
    )
    ids = {t: backend.token_to_id(t) for t in special_tokens}
    return Tokenizer(
        backend,
        bos_token_id=ids[bos],
        eos_token_ids=[ids[t] for t in eos],
        chat_template=CHATML_TEMPLATE,
        add_bos_by_default=True,
    )


# GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for chr(256 + k) in byte order.
_PRINTABLE_BYTES = [
    *range(ord("!"), ord("~") + 1),
    *range(ord("¡"), ord("¬") + 1),
    *range(ord("®"), ord("ÿ") + 1),
]
_OTHER_BYTES = [b for b in range(256) if b not in _PRINTABLE_BYTES]
# BYTE_TO_CHAR[b]: the character that spells byte b in a byte-level BPE vocabulary.
BYTE_TO_CHAR: list[str] = [""] * 256
for _code, _byte in enumerate([*_PRINTABLE_BYTES, *_OTHER_BYTES]):
    BYTE_TO_CHAR[_byte] = (
        chr(_byte) if _code < len(_PRINTABLE_BYTES) else chr(256 + _code - len(_PRINTABLE_BYTES))
    )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_id(backend: tokenizers.Tokenizer, token) -> int | None:
    """Id of a special token given as text or as transformers' AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return None if token is None else backend.token_to_id(token)


def _post_processor_adds_bos(backend: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    if bos_id is None or backend.post_processor is None:
        return False
    with_special = backend.encode("a", add_special_tokens=True).ids
    return with_special[:1] == [bos_id] and backend.encode("a", add_special_tokens=False).ids[:1] != [bos_id]


def _chat_template(folder: Path, config: dict) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template") or _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        return named.get("default", next(iter(named.values()), None))
    return template
