"""Stand-in for the course's 2025 ``tests/test_ddp_individual_parameters.py``: the overlapped DDP trains like one
process."""

from functools import partial

from .adapters import ddp_individual_parameters_on_after_backward, get_ddp_individual_parameters
from .common import check_ddp_trains_like_one_process, run_on_ranks


def test_ddp_individual_parameters(world_size):
    check = partial(check_ddp_trains_like_one_process, wrap=get_ddp_individual_parameters,
                    after_backward=ddp_individual_parameters_on_after_backward)
    run_on_ranks(check, world_size)
