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


def test_mma_rows_follow_the_kernels_tile_rules():
    pt = load_script("scripts/prefill_tiles.py", "prefill_tiles")
    # c5: one-part tiles run N = 32, 64 or 128, the smallest covering the rows
    assert pt.mma_rows(0, 5) == {"full": 0, "partial": 0, "two_part": 0}
    assert pt.mma_rows(20, 5) == {"full": 0, "partial": 32, "two_part": 0}
    assert pt.mma_rows(65, 5) == {"full": 0, "partial": 128, "two_part": 0}
    assert pt.mma_rows(128, 5) == {"full": 128, "partial": 0, "two_part": 0}
    assert pt.mma_rows(290, 5) == {"full": 256, "partial": 64, "two_part": 0}
    # c10: an expert's last <= 32 pairs join its last full tile (expert_tiles), second part 32 ...
    assert pt.mma_rows(130, 10) == {"full": 0, "partial": 0, "two_part": 160}
    assert pt.mma_rows(260, 10) == {"full": 128, "partial": 0, "two_part": 160}
    assert pt.mma_rows(161, 10) == {"full": 128, "partial": 64, "two_part": 0}
    # ... or with v44 the narrowest of 8 / 16 / 32 that covers them
    assert [pt.mma_rows(128 + x, 10, narrow=True)["two_part"] for x in (1, 8, 9, 16, 17, 32)] == [
        136,
        136,
        144,
        144,
        160,
        160,
    ]
    # c9: every tile is a 160-row one; a tile's rows past 128 take the second part
    assert pt.mma_rows(100, 9) == {"full": 0, "partial": 128, "two_part": 0}
    assert pt.mma_rows(140, 9, narrow=True) == {"full": 0, "partial": 0, "two_part": 144}
    assert pt.mma_rows(170, 9) == {"full": 0, "partial": 32, "two_part": 160}


def test_padding_shares_add_up_and_narrow_parts_only_shrink_the_two_part_kind(capsys):
    pt = load_script("scripts/prefill_tiles.py", "prefill_tiles")
    main = pt.padding(4096, 128, None, draws=2, narrow=False)
    v44 = pt.padding(4096, 128, None, draws=2, narrow=True)
    assert main["config"] == v44["config"] == 10
    for p in (main, v44):
        assert abs(p["all"] - (p["full"] + p["partial"] + p["two_part"])) < 1e-12
        assert p["full"] == 0.0  # full tiles hold exactly their rows
    assert v44["partial"] == main["partial"] and v44["two_part"] < main["two_part"] / 2
    assert 0.05 < main["two_part"] < 0.12  # bench/NOTES.md, "v44 prepared": ~8 % at 120b T = 4096
    assert pt.main(["--padding", "--draws", "1", "--tokens", "2560", "4096"]) == 0  # 80 pairs: c5
    out = capsys.readouterr().out
    assert "c5" in out and "c10" in out
