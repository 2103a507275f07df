"""The CUDA graph timer of the benchmarks (``timing.graph_replay_ms``): how many input sets it rotates through, how
many rounds one graph holds, the division of a replay over its calls, its refusal without a GPU; and on a GPU, the
copy bandwidth it measures and the capture of our RMSNorm's forward and backward."""

from __future__ import annotations

import pytest
import torch

from cs336_systems.bench.common import timing

H100_L2 = 50 * 2**20


def test_enough_input_sets_to_span_twice_the_l2_within_bounds():
    x_4096_768_bf16 = 4096 * 768 * 2
    assert timing.rotation_count(x_4096_768_bf16, H100_L2) == 17  # 6 MiB a set: 17 sets are 102 MiB > 100 MiB
    assert timing.rotation_count(2 * x_4096_768_bf16, H100_L2) == 9
    assert timing.rotation_count(H100_L2, H100_L2) == 2
    assert timing.rotation_count(2**31, H100_L2) == 2  # a set larger than the L2: still two, never one
    assert timing.rotation_count(1024, H100_L2) == 64  # tiny sets: capped
    assert timing.rotation_count(1024, H100_L2, most=8) == 8
    for set_bytes in (3 << 20, 7 << 20, 13 << 20):  # within the bounds: just enough sets
        sets = timing.rotation_count(set_bytes, H100_L2)
        assert sets * set_bytes >= 2 * H100_L2 > (sets - 1) * set_bytes


def test_rounds_make_a_replay_last_the_target_within_the_call_budget():
    assert timing.rounds_for(0.01, 16, target_ms=2.0) == 13  # 13 rounds x 16 calls x 10 us = 2.08 ms
    assert timing.rounds_for(0.01, 16, target_ms=2.0) * 16 * 0.01 >= 2.0
    assert timing.rounds_for(5.0, 2, target_ms=2.0) == 1  # one round already lasts longer
    assert timing.rounds_for(1e-4, 16, target_ms=2.0, most_calls=2048) == 128  # capped at 2048 calls
    assert timing.rounds_for(0.0, 64, most_calls=100) == 1  # the cap never goes below one round


def test_replays_are_divided_over_their_calls():
    assert timing.per_call_ms([2.0, 4.0, 3.0], 8) == [0.25, 0.5, 0.375]
    stats = timing.summarize_samples_ms(timing.per_call_ms([2.0, 4.0, 3.0], 8))
    assert stats["median_ms"] == 0.375 and stats["samples"] == 3


def test_refuses_without_a_cuda_device():
    x = torch.ones(4)
    with pytest.raises(timing.GraphCaptureError, match="CUDA device"):
        timing.graph_replay_ms(lambda inputs: inputs[0].clone(), [(x,), (x,)], torch.device("cpu"))


@pytest.mark.gpu
def test_copy_bandwidth_from_graph_replays_is_plausible_on_gpu():
    device = torch.device("cuda")
    elements = 64 * 2**20 // 4  # 64 MB of float32
    sets = timing.rotation_count(4 * elements, timing.l2_cache_bytes(device))
    inputs = [(torch.randn(elements, device=device),) for _ in range(sets)]
    stats = timing.graph_replay_ms(lambda one: one[0].clone(), inputs, device)
    gbps = 2 * 4 * elements / (stats["median_ms"] * 1e-3) / 1e9
    assert 500 < gbps < 5000, gbps
    assert stats["input_sets"] == sets >= 2 and stats["calls_per_replay"] % sets == 0
    assert stats["p20_ms"] <= stats["median_ms"] <= stats["p80_ms"]


@pytest.mark.gpu
def test_our_rmsnorm_forward_and_backward_is_captured_on_gpu():
    from cs336_systems.kernels.rmsnorm import FusedRMSNorm

    device = torch.device("cuda")
    norm = FusedRMSNorm(1024, device=device, dtype=torch.bfloat16)
    inputs = []
    for _ in range(4):
        x = torch.randn(4096, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
        inputs.append((x, torch.randn_like(x)))

    def forward_backward(one):
        x, dy = one
        return torch.autograd.grad(norm(x), (x, norm.weight), dy)

    stats = timing.graph_replay_ms(forward_backward, inputs, device)  # raises GraphCaptureError if not captured
    assert stats["median_ms"] > 0 and stats["calls_per_replay"] >= 4
    dx, dw = forward_backward(inputs[0])  # the eager call after the replays still gives the gradients
    assert torch.isfinite(dx.float()).all() and torch.isfinite(dw.float()).all()
