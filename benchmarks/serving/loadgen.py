"""How does an OpenAI-compatible endpoint serve multi-turn, shared-prefix or trace load?

The repository's runs of the installed load generator, :mod:`kvcentric.bench_serving`,
with result files.

    python -m benchmarks.serving.loadgen --base-url http://127.0.0.1:8000 \\
        --model NAME --tokenizer MODEL_DIR --workload multi-turn --num-users 8 \\
        --turns-mean 4 --turn-gap 1 --slo-ttft-ms 1000 --out result.json

Takes exactly the installed command's arguments (``python -m kvcentric.bench_serving
--help``); ``--out`` goes through :mod:`benchmarks.lib.results_writer` (commit, machine,
the summary table) with a box plot of each instance's load.
"""

from __future__ import annotations

from benchmarks.lib import results_writer
from benchmarks.serving import utilisation as plots
from kvcentric.bench_serving.loadgen import build_parser, run


def main(argv: list[str] | None = None) -> int:
    ap = build_parser("python -m benchmarks.serving.loadgen")
    args = ap.parse_args(argv)
    result = run(ap, args)
    table = result.pop("table")
    if args.out:
        figs = [results_writer.Figure(
            "utilisation", "Per-instance load (running + waiting requests) and KV usage",
            lambda p: plots.boxes([result], p, result["label"]))] \
            if result["utilisation"] else []
        results_writer.write(args.out, result, table, figs,
                             results_writer.command_line(__file__, argv))
    else:
        print(table)
    return 0 if result["summary"]["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
