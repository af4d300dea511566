"""The ``stride`` command. Each subcommand lives in the module of the role it drives, which provides
``add_arguments(parser)`` and ``main(args) -> int``; this file only routes."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from stride import env

# subcommand → (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("stride.launch.launcher", "serve a model over the OpenAI API (what scripts/launch.sh runs)"),
    "plan": ("stride.planner.cli", "capacity plan: will this model fit on these GPUs, and how much KV cache"),
    "simulate": ("stride.sim.simulate", "run a synthetic workload through the scheduler in logical time"),
    "replay": ("stride.sched.replay", "replay a recorded scheduler trace and report the first divergence"),
    "bench": ("stride.client.bench", "load-test an OpenAI-compatible endpoint"),
    "diagnose": ("stride.diagnose.cli", "run a model two ways on the same tokens: the first layer where they part"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stride", description="Stride: a serving runtime for LLMs.",
                                     epilog="environment variables:\n" + env.describe(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=env.LOG_LEVEL.get().upper(),
                        format="%(asctime)s %(processName)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name, rest = argv[0], argv[1:]
    module_name, help_text = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(f"stride {name}: not available in this build ({e})", file=sys.stderr)
            return 2
        raise
    sub = argparse.ArgumentParser(prog=f"stride {name}", description=help_text)
    module.add_arguments(sub)
    return int(module.main(sub.parse_args(rest)) or 0)


if __name__ == "__main__":
    sys.exit(main())
