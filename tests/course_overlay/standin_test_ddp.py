"""Stand-in for the course's 2026 ``tests/test_ddp.py``: the overlapped DDP, under its 2026 adapter names, trains
like one process."""

from functools import partial

from .adapters import ddp_on_after_backward, get_ddp
from .common import check_ddp_trains_like_one_process, run_on_ranks


def test_ddp(world_size):
    run_on_ranks(partial(check_ddp_trains_like_one_process, wrap=get_ddp, after_backward=ddp_on_after_backward),
                 world_size)
