"""The admission step's planner CPU (launch path: ``schedule`` + ``write``, after ``gc.collect()`` as in
``scripts/bench_admission.py``'s planner case) for bursts of 16 to 256 requests arriving at an idle scheduler:
best of 7 per size. Two sizes give the step's fixed cost and the cost of each more request.

    PYTHONPATH=<tree> python fixed_and_marginal.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from bench_admission import _admission_step


def main() -> None:
    totals = {}
    for burst in (16, 64, 128, 256):
        launch_us = min(_admission_step(burst, 0, seed)[2] for seed in range(7)) * burst
        totals[burst] = launch_us
        print(f"burst {burst:4}: launch-path CPU {launch_us:8.1f} us, {launch_us / burst:5.2f} us a request")
    marginal = (totals[256] - totals[64]) / 192
    print(f"from 64 to 256: {marginal:.2f} us a request more, fixed {totals[64] - 64 * marginal:.0f} us a step")


if __name__ == "__main__":
    main()
