"""Each pipeline rank's no-recompute windows (the peak of each stretch of its step), traced on the
GPU and by shape on the meta device, side by side: where the estimate of a rank departs from its
trace. Prints one JSON line per rank and window.

  python benchmarks/investigations/stage_windows.py [--layers 8] [--seq 4096] [--pp 2]
"""

from __future__ import annotations

import argparse
import json

from remat.config.parallel import ParallelLayout
from remat.estimate.stages import EstimateSpec, trace_stages


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="llama3_8b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    spec = EstimateSpec(
        recipe=args.recipe,
        overrides={"num_layers": args.layers, "seq_length": args.seq},
        layout=ParallelLayout(pp=args.pp),
        micro_batch_size=1,
        global_batch_size=2 * args.pp,
        device=args.device,
    )
    traced = {"device": trace_stages(spec, device=args.device), "meta": trace_stages(spec)}
    for rank in range(args.pp):
        windows = {where: {w.name: w.base_bytes for w in t[rank].trace.windows} for where, t in traced.items()}
        for name, on_device in windows["device"].items():
            print(
                json.dumps(
                    {
                        "rank": rank,
                        "window": name,
                        "device_gib": on_device / 2**30,
                        "meta_gib": windows["meta"].get(name, 0) / 2**30,
                    }
                )
            )


if __name__ == "__main__":
    main()
