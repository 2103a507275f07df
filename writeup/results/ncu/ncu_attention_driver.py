"""Two forward + backward calls of our attention, then two of SDPA's cuDNN backend, bf16 causal, at one shape, for
Nsight Compute:

    ncu --clock-control none --section SpeedOfLight python3 ncu_attention_driver.py 1,16,16384,64
"""
import sys
import torch
from cs336_systems.attention.op import flash_attention
from cs336_systems.bench.common.attention_providers import cudnn_attention, head_inputs

b, h, s, d = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,16,16384,64").split(","))
q, k, v, do = head_inputs(b, h, s, s, d, with_output_grad=True)
for fn in (lambda q, k, v: flash_attention(q, k, v, True), cudnn_attention):
    for _ in range(2):
        q1, k1, v1 = (x.detach().requires_grad_() for x in (q, k, v))
        torch.autograd.grad(fn(q1, k1, v1), (q1, k1, v1), do)
torch.cuda.synchronize()
