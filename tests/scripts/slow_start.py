"""entrypoints.train, started $ELASTICD_TEST_SLOW_START seconds late (default 0): the workers of a
node whose start takes long, as a GPU node's do (CUDA context, communicators, kernels), without
any change to the training script."""

import os
import runpy
import time

time.sleep(float(os.environ.get("ELASTICD_TEST_SLOW_START", "0")))
runpy.run_module("entrypoints.train", run_name="__main__", alter_sys=True)
