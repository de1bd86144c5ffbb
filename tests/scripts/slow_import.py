"""A module whose import takes $SLOW_IMPORT_SECONDS (default 8): a heavy `--preload` entry that
keeps a node's fork server busy past the first start."""

import os
import time

time.sleep(float(os.environ.get("SLOW_IMPORT_SECONDS", "8")))
