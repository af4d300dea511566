#!/usr/bin/env python
"""Load-test an OpenAI-compatible endpoint: the same as ``stride bench`` (see ``--help``)."""

import argparse
import sys

from stride.client import bench


def run() -> int:
    parser = argparse.ArgumentParser(prog="bench_serving.py", description=bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(parser)
    return bench.main(parser.parse_args())


if __name__ == "__main__":
    sys.exit(run())
