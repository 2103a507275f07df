"""The host cost per call of each piece of our eager attention at one shape, on a Hopper GPU, beside cuDNN's and an
autograd Function that does nothing (``empty_*``): loops of 2,000 calls without synchronisation, each piece in turn,
medians of nine rounds, microseconds. ``fb_*``: forward + ``torch.autograd.grad``; ``f_*``: the forward;
``*_direct``: the operator's forward or backward outside autograd; the rest: the Hopper backward's parts alone.

    PYTHONPATH=$PWD:$PWD/cs336-basics python3 host_breakdown.py 4,25,512,64
"""
import json
import statistics
import sys
import timeit

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.attention import op
from cs336_systems.attention.backends import common, hopper

shape = tuple(int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "4,25,512,64").split(","))
batch, heads, seq, d = shape
scale = d ** -0.5
Q, K, V = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dO = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
Qd, Kd, Vd = Q.detach(), K.detach(), V.detach()
with torch.no_grad():
    O, L = op.attention_forward(Qd, Kd, Vd, True)
dq_acc_size = batch * heads * seq * d
workspace = torch.empty((dq_acc_size + batch * heads * seq,), dtype=torch.float32, device="cuda")
Delta = workspace[dq_acc_size:]
dQ, dK, dV = torch.empty((3, *shape), dtype=Q.dtype, device="cuda").unbind(0)
key = (Q.device.index, Q.dtype, True, scale, Q.shape, K.shape, Q.stride(), K.stride(), V.stride(), dO.stride(),
       hopper._alignment(Qd, Kd, Vd, dO, L, Delta))


class Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal):
        ctx.save_for_backward(q, k, v, torch.empty_like(q), torch.empty(q.shape[:-1], device=q.device))
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(Q, K, V, is_causal=True)


pieces = {
    "fb_ours": lambda: torch.autograd.grad(op.flash_attention(Q, K, V, True), (Q, K, V), dO),
    "fb_cudnn": lambda: torch.autograd.grad(cudnn(), (Q, K, V), dO),
    "fb_empty": lambda: torch.autograd.grad(Empty.apply(Q, K, V, True), (Q, K, V), dO),
    "f_ours": lambda: op.flash_attention(Q, K, V, True),
    "f_cudnn": cudnn,
    "f_empty": lambda: Empty.apply(Q, K, V, True),
    "forward_direct": lambda: op.attention_forward(Qd, Kd, Vd, True),
    "backward_direct": lambda: op.attention_backward(Qd, Kd, Vd, O, L, dO, True),
    "hopper_backward": lambda: hopper.backward(Qd, Kd, Vd, O, L, dO, True, scale),
    "check_inputs": lambda: op.check_inputs(Q, K, V, True),
    "route": lambda: op._route("backward", Qd, Kd),
    "workspace": lambda: torch.empty((dq_acc_size + batch * heads * seq,), dtype=torch.float32, device="cuda"),
    "delta": lambda: common.launch_delta(O, dO, workspace, Delta),
    "gradients": lambda: torch.empty((3, *shape), dtype=Q.dtype, device="cuda").unbind(0),
    "backward_launch": lambda: hopper.BACKWARD.launch(key, (Qd, Kd, Vd, dO, dK, dV, workspace, L, Delta),
                                                      hopper._backward_plan, Qd, Kd, Vd, dO, True, scale,
                                                      build=hopper._backward_args),
    "dq_convert": lambda: hopper.DQ_CONVERT.launch((dQ.dtype, dQ.shape, scale), (workspace, dQ),
                                                   hopper._dq_convert_plan, dQ, scale),
}
CALLS = 2000
for piece in pieces.values():
    for _ in range(20):
        piece()
rounds: dict[str, list[float]] = {name: [] for name in pieces}
for _ in range(9):
    for name, piece in pieces.items():
        torch.cuda.synchronize()
        start = timeit.default_timer()
        for _ in range(CALLS):
            piece()
        rounds[name].append((timeit.default_timer() - start) / CALLS * 1e6)
        torch.cuda.synchronize()
print(json.dumps({"shape": shape, "median_us": {name: round(statistics.median(t), 2) for name, t in rounds.items()}},
                 indent=1))
