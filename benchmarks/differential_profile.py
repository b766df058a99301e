"""Where zerocc's step spends CPU that eager's does not: one process, no communication, op by op.

    python benchmarks/differential_profile.py --stages 0,3 --rounds 8 [--model 5m|98m]

At world size 1 zerocc's programs have no collectives, so what is left of a
difference in CPU time against a plain eager step of the same GPT
(``compare.py``'s model, batch and AdamW) is the program's own work: the
out-of-place functional optimizer, the gradient bucket ``cat``, views, the
fx program's dispatch. Prints the median CPU time per step of each system
(interleaved rounds of 3 steps), then, from one profiled step of each, the
ops whose self CPU time differs most from eager's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare  # noqa: E402  (puts zerocc and examples on the path)
import torch  # noqa: E402
import zerocc  # noqa: E402
from gpt import GPT  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", default="0,3")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--model", choices=sorted(compare.MODELS), default="5m")
    args = parser.parse_args()
    torch.set_num_threads(1)
    compare.select_model(args.model)
    generator = torch.Generator().manual_seed(1000)
    data = [compare.model_batch(generator) for _ in range(4)]
    torch.manual_seed(0)
    model = GPT(**compare.MODEL)
    systems = {"eager": compare.eager_step(model, compare.make_optimizer(model.parameters()))}
    for stage in map(int, args.stages.split(",")):
        torch.manual_seed(0)
        model = GPT(**compare.MODEL)
        systems[f"zerocc-{stage}"] = zerocc.compile(model, compare.make_optimizer(model.parameters()), stage=stage)
    for step in systems.values():
        for batch in data[:2]:
            step(*batch)
    cpu = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name, step in systems.items():
            started = time.process_time()
            for batch in data[:3]:
                step(*batch)
            cpu[name].append((time.process_time() - started) / 3 * 1e3)
    for name in systems:
        print(f"{name}: {statistics.median(cpu[name]):.1f} CPU ms / step (median of {args.rounds} rounds)")
    profiles = {}
    for name, step in systems.items():
        with torch.profiler.profile() as profile:
            step(*data[3])
        profiles[name] = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in profile.key_averages()}
    keys = set().union(*profiles.values())
    last = list(systems)[-1]

    def difference(key):
        return profiles[last].get(key, (0, 0))[0] - profiles["eager"].get(key, (0, 0))[0]
    rows = sorted(keys, key=difference, reverse=True)
    print(f"\nself CPU ms / calls in one step, sorted by {last} minus eager")
    print(f"| op | {' | '.join(systems)} |\n|---|{'---:|' * len(systems)}")
    for key in rows[:args.top] + rows[-args.top // 2:]:
        cells = " | ".join(f"{profiles[n].get(key, (0, 0))[0]:.1f} / {profiles[n].get(key, (0, 0))[1]}" for n in systems)
        print(f"| {key[:60]} | {cells} |")
    print(f"| total | {' | '.join(f'{sum(v[0] for v in profiles[n].values()):.1f}' for n in systems)} |")


if __name__ == "__main__":
    main()
