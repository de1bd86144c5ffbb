"""`python -m elasticd ARGS`: the `elasticd` command (ops/cli.py's `entry()`)."""

from elasticd.ops.cli import entry

if __name__ == "__main__":
    entry()
