"""Where the eager forward + backward's host time goes inside ``torch.autograd.grad``, at one shape, on a Hopper GPU:
the issue time per call of the plain loop; of the loop with our Function's backward, ``attention_backward`` and the
Hopper backend's ``backward`` timed as they run (on the autograd engine's device thread), each part's own time per
call; of the loop with our backward's work skipped (three new tensors returned); and of ``attention_backward`` called
directly on fixed tensors, outside autograd. Medians of five rounds of 2,000 calls.

    PYTHONPATH=$PWD:$PWD/cs336-basics python3 host_in_situ.py 4,25,512,64
"""
import json
import statistics
import sys
import time
import timeit

import torch

from cs336_systems.attention import op
from cs336_systems.attention.backends import hopper

shape = tuple(int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "4,25,512,64").split(","))
Q, K, V = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dO = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
CALLS, WARM_UP = 2000, 20
own_ns: dict[str, int] = {}


def timed(name, fn):
    def wrapper(*args):
        start = time.perf_counter_ns()
        result = fn(*args)
        own_ns[name] = own_ns.get(name, 0) + time.perf_counter_ns() - start
        return result
    return wrapper


def forward_backward():
    torch.autograd.grad(op.flash_attention(Q, K, V, True), (Q, K, V), dO)


def issue_us(call) -> float:
    for _ in range(WARM_UP):
        call()
    torch.cuda.synchronize()
    start = timeit.default_timer()
    for _ in range(CALLS):
        call()
    issued = (timeit.default_timer() - start) / CALLS * 1e6
    torch.cuda.synchronize()
    return issued


function_backward, attention_backward, hopper_backward = (op.FlashAttention2Triton.backward, op.attention_backward,
                                                          hopper.backward)
with torch.no_grad():
    O, L = op.attention_forward(Q.detach(), K.detach(), V.detach(), True)
rounds: dict[str, list[float]] = {}
for _ in range(5):
    rounds.setdefault("plain", []).append(issue_us(forward_backward))
    op.FlashAttention2Triton.backward = staticmethod(timed("Function.backward", function_backward))
    op.attention_backward = timed("attention_backward", attention_backward)
    hopper.backward = timed("hopper.backward", hopper_backward)
    own_ns.clear()
    rounds.setdefault("instrumented", []).append(issue_us(forward_backward))
    for name, ns in own_ns.items():
        rounds.setdefault(name, []).append(ns / (CALLS + WARM_UP) / 1e3)
    op.FlashAttention2Triton.backward = staticmethod(function_backward)
    op.attention_backward = lambda Q, K, V, O, L, dO, is_causal: (torch.empty_like(Q), torch.empty_like(K),
                                                                   torch.empty_like(V))
    rounds.setdefault("backward_skipped", []).append(issue_us(forward_backward))
    op.attention_backward, hopper.backward = attention_backward, hopper_backward
    rounds.setdefault("backward_direct", []).append(
        issue_us(lambda: op.attention_backward(Q.detach(), K.detach(), V.detach(), O, L, dO, True)))
print(json.dumps({"shape": shape, **{name: round(statistics.median(t), 2) for name, t in rounds.items()}}, indent=1))
