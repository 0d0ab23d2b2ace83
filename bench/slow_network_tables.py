"""Two runs of bench/slow_network.py side by side, as docs/benchmarks.md shows
them: per rate, each kind's median step in both runs, its ratio to DDP, its
accuracy; then the two checks of issue 34 per rate and run: our best
synchronous algorithm over DDP's best hook (fp16 or PowerSGD; goal: at
most 0.8 at 100 Mbit/s and 1 Gbit/s), and auto over the best candidate it
could have chosen (goal: at most 1.10), each as the ratio of the medians and
(in brackets) the median of the per-step ratios, with auto's decisions;
with `local` in the runs, issue 43's check: our best synchronous kind over
the step without communication (goal: at most 1.5) and its accuracy
against DDP's (--ddp-accuracy when DDP did not run; --accuracy-run to take
both from a longer run of the same kinds, e.g. 300 steps at loopback: the
step time does not depend on how long training runs, and 40 steps are too
few to judge what compression costs the model).

    /usr/bin/python3 bench/slow_network_tables.py bench/results/slow_network_deep_mlp_run1.json \\
        bench/results/slow_network_deep_mlp_run2.json

Prints markdown; exits 0 whatever the figures are.
"""

import argparse
import json
from typing import List

SYNCHRONOUS = ("gradient_allreduce", "bytegrad", "powersgd", "powersgd_8bit")  # auto's candidates
# The floor check's: auto's candidates and PowerSGD with the runtime's buckets
# (its default), whose accuracy is its one-bucket kind's: at two ranks the
# layout does not change the bits (test_bucket_layout_does_not_change_the_bits_at_two_ranks).
FLOOR_KINDS = SYNCHRONOUS + ("powersgd_buckets", "powersgd_8bit_buckets")
SAME_BITS_AS = {"powersgd_buckets": "powersgd", "powersgd_8bit_buckets": "powersgd_8bit"}
HOOKS = ("ddp_fp16_hook", "ddp_powersgd_hook")


def ms(value: float) -> str:
    return f"{value * 1e3:.1f}"


def kinds_table(runs: List[dict], rate: str, numbers: List[int]) -> List[str]:
    named = " / ".join(f"run {n}" for n in numbers)
    rows = [f"| kind | median step ms ({named}) | x DDP | test accuracy |", "| --- | --- | --- | --- |"]
    for kind in runs[0]["rates"][rate]:
        results = [run["rates"][rate][kind] for run in runs]
        ddp = [run["rates"][rate].get("ddp", {}).get("median") for run in runs]
        ratio = " / ".join(f"{r['median'] / d:.3f}" if d else "n/a" for r, d in zip(results, ddp))
        accuracy = " / ".join(f"{r['accuracy']:.2f}" for r in results)
        name = kind
        if kind == "auto":
            name += " (chose " + " / ".join(r["decision"]["choice"] for r in results) + ")"
        rows.append(f"| {name} | {' / '.join(ms(r['median']) for r in results)} | {ratio} | {accuracy} % |")
    return rows


def best(result: dict, kinds) -> str:
    present = [k for k in kinds if k in result]
    return min(present, key=lambda k: result[k]["median"]) if present else ""


def paired(result: dict, kind: str, baseline: str, skip: int) -> float:
    """The median over the measured steps of kind's step over baseline's in
    the same round: both ran back to back, so a burst of load hits both."""
    import statistics

    return statistics.median(a / b for a, b in zip(result[kind]["steps"][skip:], result[baseline]["steps"][skip:]))


def ratio(result: dict, kind: str, baseline: str, skip: int) -> str:
    """'kind ms / baseline ms = ratio of the medians (median of the per-step ratios)'."""
    a, b = result[kind]["median"], result[baseline]["median"]
    per_step = f" ({paired(result, kind, baseline, skip):.3f})" if "steps" in result[kind] else ""
    return f"{ms(a)} / {ms(b)} = {a / b:.3f}{per_step}"


def checks_table(runs: List[dict], numbers: List[int]) -> List[str]:
    rows = ["| rate | run | our best / DDP's best hook | auto / best candidate | auto's decisions "
            "(step: choice, predicted / measured ms) |", "| --- | --- | --- | --- | --- |"]
    for rate in runs[0]["rates"]:
        for number, run in zip(numbers, runs):
            result, skip = run["rates"][rate], run["config"]["skip_steps"]
            ours, hook = best(result, SYNCHRONOUS), best(result, HOOKS)
            first = f"{ratio(result, ours, hook, skip)}: {ours} / {hook}" if ours and hook else "n/a"
            second = ratio(result, "auto", ours, skip) if ours and "auto" in result else "n/a"
            rows.append(f"| {rate} | {number} | {first} | {second} | {decisions(result.get('auto'))} |")
    return rows


def floor_table(runs: List[dict], numbers: List[int], ddp_accuracy=None, accuracy_run=None,
                kinds=FLOOR_KINDS) -> List[str]:
    """Issue 43's check: our best synchronous kind over `local`, the step
    without communication (goal: at most 1.5), and its accuracy against
    DDP's (within 1.5 points; ``ddp_accuracy`` when DDP did not run here;
    both from ``accuracy_run``, a report of one longer run, when given);
    "our best" is the fastest of ``kinds``."""
    heading = "its accuracy / DDP's"
    if accuracy_run:
        config = accuracy_run["config"]
        heading += f" after {config['steps']} steps"
        if config.get("accuracy_tail"):
            heading += f" (mean over the last {config['accuracy_tail']})"
    rows = [f"| rate | run | our best / local (no communication) | {heading} |",
            "| --- | --- | --- | --- |"]
    for rate in runs[0]["rates"]:
        for number, run in zip(numbers, runs):
            result, skip = run["rates"][rate], run["config"]["skip_steps"]
            ours = best(result, kinds)
            if not ours or "local" not in result:
                continue
            source = result
            if accuracy_run:
                source = next(iter(accuracy_run["rates"].values()))
            def final(q):  # the mean over the run's last steps (--accuracy-tail) where it has one
                return q.get("accuracy_tail_mean", q["accuracy"])

            ddp = final(source["ddp"]) if "ddp" in source else ddp_accuracy
            mine = final(source[ours] if ours in source or ours not in SAME_BITS_AS else source[SAME_BITS_AS[ours]])
            accuracy = f"{mine:.2f} / {ddp:.2f} %" if ddp is not None else f"{mine:.2f} % / n/a"
            rows.append(f"| {rate} | {number} | {ratio(result, ours, 'local', skip)}: {ours} | {accuracy} |")
    return rows


def breakdown_table(runs: List[dict], numbers: List[int], labels: List[str], kind: str) -> List[str]:
    """Where `kind`'s median step went on rank 0 (runs made with --breakdown):
    compute (to the last gradient ready), the op's factor passes and
    exchanges after it, waiting, the optimizer step; `local`'s stages beside
    it (forward + backward, optimizer step)."""
    rows = ["| code | rate | run | step ms | compute | factor passes (project + back + reconstruct) | "
            "exchanges (P + Q) | waiting | optimizer | local: step, forward + backward, optimizer |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for rate in runs[0]["rates"]:
        for label, number, run in zip(labels, numbers, runs):
            parts = (run.get("breakdown", {}).get(rate) or [{}])[0].get(kind)
            result = run["rates"][rate]
            if parts is None or kind not in result:
                continue
            passes = [parts.get(f"powersgd.{p}", 0.0) for p in ("project", "project_back", "reconstruct")]
            exchanges = [parts.get(f"powersgd.exchange_{p}", 0.0) for p in ("p", "q")]
            local = ""
            if "local" in result:
                stages = result["local"]["stages_median"]
                local = (f"{ms(result['local']['median'])}, {ms(stages['forward'] + stages['backward'])}, "
                         f"{ms(stages['step'])}")
            rows.append(f"| {label} | {rate} | {number} | {ms(result[kind]['median'])} | {parts['compute']:.1f} | "
                        f"{sum(passes):.1f} ({' + '.join(f'{x:.1f}' for x in passes)}) | "
                        f"{sum(exchanges):.1f} ({' + '.join(f'{x:.1f}' for x in exchanges)}) | "
                        f"{parts['waiting']:.1f} | {parts['optimizer']:.1f} | {local} |")
    return rows


def decisions(auto) -> str:
    if not auto:
        return ""
    parts = []
    for d in auto.get("decisions") or [auto["decision"]]:
        predicted = d.get("predicted_step_s", {}).get(d["choice"])
        measured = d.get("measured_step_s", {}).get(d["choice"])
        numbers = f"{ms(predicted) if predicted else '-'} / {ms(measured) if measured else '-'}"
        parts.append(f"{d.get('step', '-')}: {d['choice']}, {numbers}")
    return "; ".join(parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="bench/slow_network.py reports (--out), in run order")
    parser.add_argument("--ddp-accuracy", type=float, default=None,
                        help="DDP's accuracy after the same steps, for runs without DDP (its bits do not depend "
                             "on the link)")
    parser.add_argument("--accuracy-run", default=None,
                        help="a report of a longer run of the same kinds with DDP (e.g. 300 steps at loopback): "
                             "the floor check takes both accuracies from it")
    parser.add_argument("--floor-kinds", default=",".join(FLOOR_KINDS),
                        help="the kinds the floor check takes the fastest of (e.g. only those whose accuracy "
                             "holds)")
    parser.add_argument("--breakdown-kind", default="",
                        help="also print where this kind's step went (runs made with --breakdown)")
    parser.add_argument("--labels", default="", help="with --breakdown-kind: a label per run, e.g. before,after")
    parser.add_argument("--numbers", default="", help="the runs' numbers in the tables, e.g. 3,4 (default 1, 2, ...)")
    args = parser.parse_args()
    runs = []
    for path in args.runs:
        with open(path) as f:
            runs.append(json.load(f))
    numbers = [int(n) for n in args.numbers.split(",")] if args.numbers else list(range(1, len(runs) + 1))
    if len(numbers) != len(runs):
        parser.error(f"--numbers names {len(numbers)} runs, {len(runs)} given")
    config = runs[0]["config"]
    print(f"model {config.get('model', 'mlp')}, rank {config['rank']}, {config['steps']} steps, "
          f"median over steps {config['skip_steps'] + 1}-{config['steps']}")
    for rate in runs[0]["rates"]:
        print(f"\n**{rate}{'' if rate == 'loopback' else ' Mbit/s'}**\n")
        print("\n".join(kinds_table(runs, rate, numbers)))
    print()
    print("\n".join(checks_table(runs, numbers)))
    if args.breakdown_kind:
        labels = args.labels.split(",") if args.labels else [""] * len(runs)
        print()
        print("\n".join(breakdown_table(runs, numbers, labels, args.breakdown_kind)))
    if any("local" in result for run in runs for result in run["rates"].values()):
        print()
        accuracy_run = None
        if args.accuracy_run:
            with open(args.accuracy_run) as f:
                accuracy_run = json.load(f)
        print("\n".join(floor_table(runs, numbers, args.ddp_accuracy, accuracy_run, args.floor_kinds.split(","))))


if __name__ == "__main__":
    main()
