"""The benchmark runner: every registered benchmark (or the ones named), one table, exit 1 on a miss."""
import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `python mini_dist/bench`
from mini_dist import bench
from mini_dist.kit import launch


def registry() -> dict:
    benches = {}
    for info in sorted(pkgutil.iter_modules(bench.__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            benches.update(importlib.import_module(f"mini_dist.bench.{info.name}").BENCHES)
    return benches


def run(args) -> int:
    benches = registry()
    unknown = [n for n in args.names if n not in benches]
    launch.require(not unknown, f"no benchmark named {', '.join(unknown)}; choose from {', '.join(benches)}")
    env = launch.setup()
    results = []
    for name in args.names or benches:
        launch.print0(f"\n=== {name} ({env.world_size} ranks, {env.backend}/{env.device.type}) ===")
        results += benches[name](args)
    launch.print0("\n" + bench.table(results))
    missed = [r.name for r in results if not r.ok]
    launch.print0(f"\n{len(results) - len(missed)} of {len(results)} within target"
                  + (f"; missed: {', '.join(missed)}" if missed else ""))
    launch.shutdown()
    return 1 if missed else 0


def parser() -> argparse.ArgumentParser:
    p = launch.demo_parser(bench.__doc__)
    p.add_argument("names", nargs="*", help="benchmarks to run (default: all); see --list")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    return p


def main(argv=None) -> int:
    def dispatch(args):
        if args.list:
            launch.print0("\n".join(registry()))
            return 0
        return run(args)
    return launch.main(parser(), dispatch, argv)


if __name__ == "__main__":
    raise SystemExit(main())
