"""`python -m elasticd ARGS`: the `elasticd` command (elasticd.ops.cli)."""

from elasticd.ops.cli import entry

if __name__ == "__main__":
    entry()
