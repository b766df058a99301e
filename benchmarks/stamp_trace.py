"""Capture's trace CPU seconds of the 98M GPT shape at a given depth, with or without ZEROCC_STAMP=1 (issue 21).

    ZEROCC_STAMP=1 python benchmarks/stamp_trace.py 24   # prints RESULT layers stamp trace optimizer tag-and-check nodes
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.gpt import GPT  # noqa: E402
from zerocc import capture as cap  # noqa: E402
from zerocc.tracing import make_fake_mode  # noqa: E402

torch.set_num_threads(1)
time.perf_counter = time.process_time   # zerocc's phase clock (compile_stats) in CPU seconds of this process
layers = int(sys.argv[1])
torch.manual_seed(0)
model = GPT(vocab=8192, d_model=768, layers=layers, heads=12, seq=128)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
tokens = torch.randint(0, 8192, (2, 129))
c = cap.capture(model, opt, [tokens[:, :-1], tokens[:, 1:]], loss_fn=None, num_targets=0, fake_mode=make_fake_mode())
s = c.stats.seconds
print("RESULT", layers, os.environ.get("ZEROCC_STAMP", "0"), round(s["capture: trace"], 3), round(s["capture: optimizer"], 3),
      round(s["capture: tag and check"], 3), len(c.gm.graph.nodes))
