"""The toy-training script runs end to end and checks every variant (one spawn, gloo on CPU)."""

from __future__ import annotations

import pytest

from cs336_systems.parallel.ddp import toy_training


def test_toy_training_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        toy_training.main(["--help"])
    assert exit_info.value.code == 0
    assert "--world-size" in capsys.readouterr().out


@pytest.mark.slow  # one spawn training every variant
def test_toy_training_matches_single_process(capfd):
    # The ranks print from their own processes: capture at the file-descriptor level.
    toy_training.main(["--backend", "gloo", "--steps", "3"])
    out = capfd.readouterr().out
    assert "backend: gloo" in out
    for variant in toy_training.VARIANTS:
        assert f"{variant}: max |w - w_single|" in out
    assert "all variants match single-process training" in out
