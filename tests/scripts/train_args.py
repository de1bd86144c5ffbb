"""The command line the framework scripts (tests/scripts/*_train.py) share: run length, where
their checkpoints go, and what the tests and benchmarks read back."""

import argparse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5, help="the framework's disk checkpoint")
    p.add_argument("--out", required=True, help="the framework's checkpoint directory")
    p.add_argument("--step-time", type=float, default=0.0, help="a sleep per step, seconds")
    p.add_argument("--step-log", default="", help="one line per step: rank step pid time")
    p.add_argument("--final", default="", help="rank 0 saves the final weights and optimizer")
    p.add_argument("--memory-every", type=int, default=None, help="elasticd's integration on")
    return p
