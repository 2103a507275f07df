"""cs336_basics training utilities: softmax, cross-entropy, clipping, AdamW, schedule, batching."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cs336_basics.data import get_batch
from cs336_basics.nn_utils import clip_gradient, cross_entropy, log_softmax, softmax
from cs336_basics.optimizer import AdamW, get_cosine_lr


def test_softmax_matches_torch_and_is_stable():
    x = torch.randn(4, 7, 13)
    torch.testing.assert_close(softmax(x, dim=-1), F.softmax(x, dim=-1))
    torch.testing.assert_close(softmax(x, dim=1), F.softmax(x, dim=1))
    torch.testing.assert_close(log_softmax(x, dim=-1), F.log_softmax(x, dim=-1))
    big = x + 1e4
    assert torch.isfinite(softmax(big)).all()
    torch.testing.assert_close(softmax(big), F.softmax(big, dim=-1))
    torch.testing.assert_close(softmax(x.double() + 1e4), F.softmax(x.double(), dim=-1))


def test_cross_entropy_matches_torch_and_is_stable():
    logits = torch.randn(3, 5, 20)
    targets = torch.randint(0, 20, (3, 5))
    expected = F.cross_entropy(logits.reshape(-1, 20), targets.reshape(-1))
    torch.testing.assert_close(cross_entropy(logits, targets), expected)
    large = logits * 1000
    loss = cross_entropy(large, targets)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, F.cross_entropy(large.reshape(-1, 20), targets.reshape(-1)))


def test_clip_gradient_matches_torch():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    frozen = torch.nn.Parameter(torch.randn(2))  # no gradient: must be skipped
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, c in zip(params, clones):
        p.grad = torch.randn_like(p) * 10
        c.grad = p.grad.clone()
    clip_gradient(params + [frozen], max_l2_norm=1.0)
    torch.nn.utils.clip_grad_norm_(clones, max_norm=1.0)
    for p, c in zip(params, clones):
        torch.testing.assert_close(p.grad, c.grad, rtol=1e-5, atol=1e-6)
    # Below the threshold nothing changes.
    before = [p.grad.clone() for p in params]
    clip_gradient(params, max_l2_norm=1e6)
    for p, b in zip(params, before):
        torch.testing.assert_close(p.grad, b)


def test_adamw_matches_torch_over_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    kwargs = dict(lr=3e-3, betas=(0.85, 0.95), eps=1e-6, weight_decay=0.1)
    ours, theirs = AdamW(model.parameters(), **kwargs), torch.optim.AdamW(reference.parameters(), **kwargs)
    for _ in range(15):
        x, y = torch.randn(32, 8), torch.randn(32, 4)
        for m, opt in ((model, ours), (reference, theirs)):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_adamw_rejects_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError):
        AdamW(p, lr=-1.0)
    with pytest.raises(ValueError):
        AdamW(p, betas=(1.0, 0.9))


def test_cosine_schedule_corners():
    kw = dict(max_learning_rate=1.0, min_learning_rate=0.1, warmup_iters=10, cosine_cycle_iters=110)
    assert get_cosine_lr(0, **kw) == 0.0
    assert get_cosine_lr(5, **kw) == pytest.approx(0.5)
    assert get_cosine_lr(10, **kw) == pytest.approx(1.0)
    assert get_cosine_lr(60, **kw) == pytest.approx(0.55)
    assert get_cosine_lr(110, **kw) == pytest.approx(0.1)
    assert get_cosine_lr(500, **kw) == pytest.approx(0.1)
    values = [get_cosine_lr(i, **kw) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert get_cosine_lr(35, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.25)))


def test_get_batch_shapes_and_ranges():
    data = np.arange(100)
    np.random.seed(0)
    x, y = get_batch(data, batch_size=64, context_length=7, device="cpu")
    assert x.shape == y.shape == (64, 7) and x.dtype == torch.long
    torch.testing.assert_close(y, x + 1)  # targets are the inputs shifted by one
    assert x.min() >= 0 and y.max() <= 99
    assert len(set(x[:, 0].tolist())) > 10  # starting points vary
    assert (x[:, 0] <= 100 - 7 - 1).all()
    with pytest.raises(ValueError):
        get_batch(np.arange(5), batch_size=1, context_length=5)
