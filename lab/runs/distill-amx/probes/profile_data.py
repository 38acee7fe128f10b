"""Where the data phase's time goes on this CPU: torch's profiler and cProfile over 32 answers
made at once (the suite's four low-acceptance categories, as data_rate.py), by the target on
4-bit weights (`int4`) or bfloat16 through PyTorch (`bf16-torch`).

    PYTHONPATH=src python lab/runs/distill-amx/probes/profile_data.py int4
"""

import cProfile
import pstats
import runpy
import sys

from torch.profiler import ProfilerActivity, profile

which = sys.argv[1]
sys.argv = ["data_rate.py", f"{which}:32"]  # its models and jobs; it times nothing unless main
probe = runpy.run_path(__file__.replace("profile_data.py", "data_rate.py"))
engine, jobs, run = probe["engines"][which], probe["jobs"], probe["run"]
run(engine, jobs[:8], 8)  # warm-up
pr = cProfile.Profile()
pr.enable()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    run(engine, jobs[:32], 32)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(15)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
