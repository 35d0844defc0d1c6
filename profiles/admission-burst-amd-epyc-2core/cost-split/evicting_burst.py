"""An admission burst into a KV cache full of cached blocks: what a server that has run a while sees with prefix
caching on (freed blocks stay cached until evicted, so the free stack of never-used blocks runs out early). A first
wave of ``burst`` requests fills the cache (every block cached and evictable once they finish); then ``burst`` new
ones, 32-token prompts that hit nothing, arrive at the idle scheduler: every admission evicts. Launch-path CPU of
that admission step (``schedule`` + ``write``) per request, best of 7, warm (no ``gc.collect``), with the number of
blocks evicted and of array batches (``Admitter._apply`` calls) it took. The rig is ``scripts/bench_admission.py``'s
``cache_burst`` (its ``cache`` case runs the 256 one).

    PYTHONPATH=<tree> python evicting_burst.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from bench_admission import PROMPT_LEN, cache_burst


def main() -> None:
    for burst in (64, 256):
        runs = [cache_burst(seed, burst, PROMPT_LEN, 2 * burst + 1) for seed in range(7)]
        print(f"burst {burst}: {min(r[0] for r in runs):6.2f} us a request (launch-path CPU), "
              f"{runs[0][2]} blocks evicted, {runs[0][1]} array batches")


if __name__ == "__main__":
    main()
