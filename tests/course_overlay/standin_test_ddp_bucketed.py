"""Stand-in for the course's 2025 ``tests/test_ddp.py``: the bucketed DDP trains like one process, with buckets of
every tensor alone and of all of them together."""

from functools import partial

import pytest

from .adapters import ddp_bucketed_on_after_backward, ddp_bucketed_on_train_batch_start, get_ddp_bucketed
from .common import check_ddp_trains_like_one_process, run_on_ranks


@pytest.mark.parametrize("bucket_size_mb", [0.0001, 100])
def test_ddp_bucketed(world_size, bucket_size_mb):
    check = partial(check_ddp_trains_like_one_process, wrap=partial(get_ddp_bucketed, bucket_size_mb=bucket_size_mb),
                    after_backward=ddp_bucketed_on_after_backward, batch_start=ddp_bucketed_on_train_batch_start)
    run_on_ranks(check, world_size)
