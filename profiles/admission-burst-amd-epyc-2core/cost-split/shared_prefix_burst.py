"""An admission burst of 96 requests with 80-token prompts at an idle scheduler, launch-path CPU (``schedule`` +
``write``) per request, best of 7 rigs, warm (no ``gc.collect``) and cold (after one): prompts that share nothing
(``shared prefix False``), and prompts that share a 64-token prefix (4 blocks) the cache holds from a first wave,
then 16 tokens of their own (``True``: each admission a cache hit on 4 blocks). The rig is
``scripts/bench_admission.py``'s ``cache_burst`` (its ``cache`` case runs the warm ones).

    PYTHONPATH=<tree> python shared_prefix_burst.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from bench_admission import cache_burst


def main() -> None:
    for shared in (False, True):
        for cold in (False, True):
            runs = [cache_burst(seed, 96, 80, 96 * 8 + 64, shared_prefix=64 if shared else 0, cold=cold)
                    for seed in range(7)]
            print(f"shared prefix {shared!s:5} cold {cold!s:5}: {min(r[0] for r in runs):5.2f} us a request, "
                  f"cached tokens {runs[0][3]}")


if __name__ == "__main__":
    main()
