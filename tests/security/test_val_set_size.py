"""`val_set_size: 1.0` held out one example while the docs say "a share below 1 or a whole count": 1 reads both ways
(every example as a share, one as a count), so it is refused in one line with what to write instead (red team 2,
defect 20). Shares below 1 and whole counts of 2 or more are unchanged."""

from __future__ import annotations

import pytest

from hybridtune.config import load_config


@pytest.mark.parametrize("given", ["1", "1.0", "1.00"])
def test_one_is_refused_with_what_to_write(tmp_path, small_data, error_line, given):
    line = error_line(["data", "--dataset", small_data, "--val_set_size", given, "--output_dir", str(tmp_path / "o")])
    assert "'val_set_size' = 1.0 must be a share below 1 or a whole count of examples (1 is refused" in line, line
    assert "as a share it holds out every example, as a count one: give 2 or more" in line, line


@pytest.mark.parametrize("given", [0, 0.5, 0.999, 2, 2.0, 37])
def test_shares_and_counts_of_two_or_more_are_unchanged(tmp_path, given):
    cfg = load_config(None, {"val_set_size": given, "output_dir": str(tmp_path / "o")}, warn=False)
    assert cfg.val_set_size == given
