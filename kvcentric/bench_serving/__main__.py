"""``python -m kvcentric.bench_serving``: the load generator's command line."""

from kvcentric.bench_serving.loadgen import main
from kvcentric.extras import run_cli

if __name__ == "__main__":
    raise SystemExit(run_cli("kvcentric.bench_serving", main))
