"""MAX's stock gpt_oss architecture, unchanged except where its weights come from: a synthetic
model's weights are generated in memory (its directory holds a header-only stub), as ours are.

The end-to-end benchmark loads it as `--custom-architectures gptoss_max.stock` (in its own
process) to compare MAX's stock pipeline with ours on the same synthetic checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gptoss_max import maxapi
from gptoss_max.arch.weights import SyntheticWeights
from gptoss_max.synthetic import SyntheticModel

ARCH_MODULE = "gptoss_max.stock"


class StockGptOssModel(maxapi.GptOssModel):
    def _load_state_dict(self) -> dict[str, Any]:
        synthetic = SyntheticModel.from_hf_config(self.huggingface_config.to_dict())
        if synthetic:
            self.weights = SyntheticWeights.generate(synthetic)
        return super()._load_state_dict()


ARCHITECTURES = [dataclasses.replace(maxapi.stock_gpt_oss_arch, pipeline_model=StockGptOssModel)]
