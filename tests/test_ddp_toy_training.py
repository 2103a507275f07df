"""The toy-training check: every variant's weights against one process after a few steps (one spawn through the
harness), and the command line end to end."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from cs336_systems.bench import naive_ddp
from cs336_systems.parallel.ddp import toy_training
from tests._distributed import assert_all_passed, run_checks


def check_variant_matches(rank: int, world_size: int, device: torch.device, variant: str) -> None:
    args = toy_training.ToyTraining(steps=3)
    difference = toy_training.max_weight_difference(variant, rank, world_size, device, args)
    assert difference <= args.atol, f"{variant}: max |w - w_single| = {difference:.2e} > {args.atol}"


def test_toy_training_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        naive_ddp.main(["--help"])
    assert exit_info.value.code == 0
    assert "--world-size" in capsys.readouterr().out


@pytest.mark.slow  # one spawn training every variant (PyTorch's DDP too): about 20 s on two cores
def test_every_variant_matches_single_process():
    variants = (*toy_training.VARIANTS, "torch_ddp")
    assert_all_passed(run_checks({v: partial(check_variant_matches, variant=v) for v in variants}, 2))


@pytest.mark.slow  # a spawn
def test_command_line_runs_end_to_end():
    # Raises (a rank's assertion, through spawn) if any variant's weights differ from one process's.
    naive_ddp.main(["--backend", "gloo", "--quick", "--variants", "naive", "sharded-optimizer"])


def test_unknown_variant_is_refused(capsys):
    with pytest.raises(SystemExit):
        naive_ddp.main(["--variants", "flattened"])
    assert "unknown DDP variant 'flattened'" in capsys.readouterr().err
