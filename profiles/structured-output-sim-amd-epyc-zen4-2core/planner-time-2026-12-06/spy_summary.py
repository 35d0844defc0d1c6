"""The planner thread's busy samples in a py-spy raw profile (``--threads -f raw``), by function (inclusive, then
self), leaving out its waits and what happens once a run (warm-up, admission of the 256 requests)."""
import sys
from collections import Counter

ONCE = ("warm_up", "LiveRequests.admit", "_handle ")
WAITS = ("Event.wait", "Condition.wait", "wait (threading")
GENERIC = ("thread (", "Thread.", "EngineCore._run ")
inclusive, own, busy, idle = Counter(), Counter(), 0, 0
with open(sys.argv[1]) as profile:
    for line in profile:
        stack, count = line.rstrip().rsplit(" ", 1)
        frames, n = stack.split(";"), int(count)
        if "planner" not in frames[0] or any(k in f for f in frames for k in ONCE):
            continue
        if any(k in frames[-1] for k in WAITS):
            idle += n
            continue
        busy += n
        own[frames[-1]] += n
        for frame in set(frames):
            if not frame.startswith(GENERIC):
                inclusive[frame] += n
print(f"planner: {busy} busy samples, {idle} waiting")
for title, counts in (("inclusive", inclusive), ("self", own)):
    print(f"-- {title}")
    for frame, n in counts.most_common(12):
        print(f"{n:6d} {n / busy:6.1%}  {frame[:120]}")
