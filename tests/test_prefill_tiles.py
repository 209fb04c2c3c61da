"""scripts/prefill_tiles.py: the tile count behind bench/NOTES.md's "p5 analysis"."""

from __future__ import annotations

import numpy as np

from script_loader import load_script


def test_tiles_round_each_expert_up_and_skip_empty_ones():
    pt = load_script("scripts/prefill_tiles.py", "prefill_tiles")
    assert pt.tiles(np.array([0, 1, 128, 129, 256]), 128) == 0 + 1 + 1 + 2 + 2


def test_uniform_routing_needs_half_a_tile_more_at_one_tile_per_expert(capsys):
    pt = load_script("scripts/prefill_tiles.py", "prefill_tiles")
    # 120b at T = 4096: ~128 pairs per expert, about half the experts spill into a second tile
    assert 1.4 < pt.tiles_per_bm_pairs(4096, 128, 128, draws=4) < 1.6
    # 64 pairs per expert never exceed one 128-token tile: exactly 2 tiles per 128 pairs
    assert pt.tiles_per_bm_pairs(2048, 128, 128, draws=2) == 2.0
    assert pt.main(["--draws", "2"]) == 0
    out = capsys.readouterr().out
    assert "4096" in out and "16384" in out
