import json, sys
for name in sys.argv[1:]:
    t = json.load(open(f"/tmp/adm3/sp/{name}/trace.json"))
    ev = t["traceEvents"] if isinstance(t, dict) else t
    fw = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("ph") == "X" and e.get("name") == "forward" and e.get("pid") == 900000000)
    gaps = [(i, round((fw[i][0] - fw[i-1][1]) / 1e3, 2)) for i in range(1, len(fw)) if fw[i][0] - fw[i-1][1] > 50]
    tot = sum(g for _, g in gaps)
    first = sum(g for i, g in gaps if i <= 6); last = sum(g for i, g in gaps if i >= len(fw) - 12)
    print(name, f"total {tot:.1f} ms, first 6 steps {first:.1f}, last 12 {last:.1f}, middle {tot-first-last:.1f}:", gaps[:40])
