"""ampkit.plan of a 6.7B-parameter LM (32 blocks, d 4096, ffn 11008, vocab 32000) on fake tensors: time and memory.

python benchmarks/plan_7b.py fp32,bf16-true,bf16-master
"""

import resource
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import ampkit


class Block(nn.Module):
    def __init__(s, d, f):
        super().__init__()
        s.n1, s.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        s.qkv, s.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        s.up, s.gate, s.down = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(s, x):
        q, k, v = s.qkv(s.n1(x)).chunk(3, -1)
        x = x + s.o(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        h = s.n2(x)
        return x + s.down(F.silu(s.gate(h)) * s.up(h))


class LM(nn.Module):
    def __init__(s, V=32000, d=4096, f=11008, L=32):
        super().__init__()
        s.emb = nn.Embedding(V, d)
        s.blocks = nn.ModuleList(Block(d, f) for _ in range(L))
        s.head = nn.Linear(d, V, bias=False)

    def forward(s, idx):
        x = s.emb(idx)
        for b in s.blocks:
            x = b(x)
        return s.head(x)


x = torch.randint(0, 32000, (1, 128))
y = torch.randint(0, 32000, (1, 128))
t = time.time()
res = ampkit.plan(
    LM,
    lambda: (x, y),
    lambda p: torch.optim.AdamW(p, lr=1e-4),
    sys.argv[1].split(","),
    "cpu",
    memory="2TB",
    loss_fn=lambda out, tgt: F.cross_entropy(out.flatten(0, 1), tgt.flatten()),
    search=False,
)
print(
    f"params {res.parameter_count / 1e9:.2f}B, {time.time() - t:.1f} s, "
    f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
)
for r in res.rows:
    print(r.precision, f"{r.peak_bytes / 2**30:.1f} GiB", r.method, r.note)
