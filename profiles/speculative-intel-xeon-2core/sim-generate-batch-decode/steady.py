"""Busy over the whole run and over the steps with all 256 rows decoding (plan events' "decode" == 256), from
the traces of issue_command_ab.sh: `python steady.py $(ls runs)` (run names <tree>-<mode>-<round>)."""
import json, sys, statistics, collections
res = collections.defaultdict(lambda: collections.defaultdict(list))
for name in sys.argv[1:]:
    t = json.load(open(f"./runs/{name}/trace.json")); ev = t["traceEvents"] if isinstance(t, dict) else t
    P = 900000000
    fw = {e["args"]["step"]: (e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("ph") == "X" and e["name"] == "forward" and e["pid"] == P}
    dec = {e["args"]["step"]: e["args"]["decode"] for e in ev if e.get("ph") == "X" and e["pid"] == P and e["tid"] == 1 and e["name"].startswith("plan ")}
    steps = sorted(fw)
    full = [s for s in steps if dec.get(s) == 256]
    def busy(ss):
        ss = [s for s in ss if s in fw]
        span = fw[ss[-1]][1] - fw[ss[0]][0]
        return 100 * sum(fw[s][1] - fw[s][0] for s in ss) / span
    tree, mode = name.split("-")[0], name.split("-")[-2]
    res[(tree, mode)]["whole"].append(busy(steps))
    # the contiguous run of 256-row steps
    res[(tree, mode)]["steady"].append(busy(list(range(full[0], full[-1] + 1))))
    res[(tree, mode)]["nsteady"].append(full[-1] - full[0] + 1)
for k, v in sorted(res.items()):
    print(k, {m: (round(statistics.median(x), 2), [round(y, 1) for y in x]) for m, x in v.items()})
