"""Cost of one heartbeat: elasticd.heartbeat() and the automatic optimizer-step hook.

python bench/heartbeat.py
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time


def per_call(fn, n: int = 200_000, repeats: int = 5) -> float:
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n)
    return statistics.median(runs)


def main() -> None:
    from elasticd.worker import heartbeat

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "hb")
        heartbeat.create(path)
        os.environ["ELASTICD_HEARTBEAT_FILE"] = path
        import elasticd

        beat = per_call(elasticd.heartbeat)
        beat_step = per_call(lambda: elasticd.heartbeat(step=7))
        off = per_call(lambda: None)

        import torch
        import torch.optim.optimizer as optimizer_module

        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=0.0)
        p.grad = torch.zeros(1)
        bare = per_call(opt.step, n=20_000)
        handle = optimizer_module.register_optimizer_step_post_hook(lambda *_: elasticd.heartbeat())
        hooked = per_call(opt.step, n=20_000)
        handle.remove()
        assert heartbeat.read(path).beats > 0
    print("heartbeat cost per call (median of 5 runs)")
    print(f"  elasticd.heartbeat()          {1e6 * (beat - off):6.2f} us")
    print(f"  elasticd.heartbeat(step=N)    {1e6 * (beat_step - off):6.2f} us")
    print(
        f"  optimizer.step() hook added   {1e6 * (hooked - bare):6.2f} us "
        f"(tiny SGD step {1e6 * bare:.1f} us -> {1e6 * hooked:.1f} us)"
    )


if __name__ == "__main__":
    main()
