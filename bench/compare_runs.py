"""Two runs of bench/step_time.py side by side, as docs/benchmarks.md shows
them: each kind's median step time in both runs, the first run's p90 and
stage medians, the ratio to DDP of each run with its range over the
repeats, and whether the second run's ratio is within 5 % of the first's.

    /usr/bin/python3 bench/compare_runs.py bench/results/step_time_t113_run1.json bench/results/step_time_t113_run2.json

Prints a markdown table; exits 0 whatever the figures are.
"""

import argparse
import json
import statistics
from typing import List, Tuple

TOLERANCE = 0.05


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def ratios(run: dict, world: str, model: str, kind: str) -> List[float]:
    """This kind's median step time over DDP's, one per repeat."""
    out = []
    for repeat in run["repeats"]:
        stages = repeat[world][model]["stages"]
        out.append(stages[kind]["total"]["median"] / stages["ddp"]["total"]["median"])
    return out


def median_over_repeats(run: dict, world: str, model: str, kind: str, stage: str, field: str = "median") -> float:
    return statistics.median(r[world][model]["stages"][kind][stage][field] for r in run["repeats"])


def rows(first: dict, second: dict) -> List[Tuple]:
    out = []
    repeat = first["repeats"][0]
    for world in sorted(repeat, key=int):
        for model in repeat[world]:
            for kind in repeat[world][model]["stages"]:
                r1, r2 = ratios(first, world, model, kind), ratios(second, world, model, kind)
                m1, m2 = statistics.median(r1), statistics.median(r2)
                def ms(run, stage, field="median"):
                    return 1000 * median_over_repeats(run, world, model, kind, stage, field)

                out.append((model, world, kind, ms(first, "total"), ms(second, "total"), ms(first, "total", "p90"),
                            ms(first, "forward"), ms(first, "backward"), ms(first, "step"),
                            (m1, min(r1), max(r1)), (m2, min(r2), max(r2)), abs(m2 - m1) <= TOLERANCE * m1))
    return out


def ratio_text(ratio: Tuple[float, float, float]) -> str:
    median, low, high = ratio
    return f"{median:.3f} ({low:.3f}-{high:.3f})"


def markdown(table: List[Tuple]) -> str:
    lines = ["| model | world | kind | step ms run 1 / run 2 | p90 ms (run 1) | forward / backward / step ms (run 1) "
             "| x DDP run 1 (range over 3) | x DDP run 2 (range over 3) | within 5 % |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model, world, kind, t1, t2, p90, fwd, bwd, step, r1, r2, ok in table:
        lines.append(f"| {model} | {world} | {kind} | {t1:.1f} / {t2:.1f} | {p90:.1f} | {fwd:.1f} / {bwd:.1f} / "
                     f"{step:.1f} | {ratio_text(r1)} | {ratio_text(r2)} | {'yes' if ok else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first")
    parser.add_argument("second")
    args = parser.parse_args()
    print(markdown(rows(load(args.first), load(args.second))))


if __name__ == "__main__":
    main()
