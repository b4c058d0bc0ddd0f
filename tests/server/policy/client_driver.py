"""Run by test_policy_openpi.py in openpi-client's environment (numpy 1.26), with clients/python on the path:
streamserve_client's SyncPolicyClient under NumPy 1.x (the test environment has 2.x). Prints one JSON line."""

from __future__ import annotations

import json
import sys

import numpy as np

from streamserve_client.policy import SyncPolicyClient


def main() -> None:
    url = sys.argv[1]
    out: dict = {"numpy": np.__version__, "ticks": []}
    with SyncPolicyClient(url) as policy:
        for step in range(3):
            r = policy.infer({"observation/state": np.array([0.1 * step, 0.0, -0.5], np.float64)}, step=step,
                             timestamp=float(step) / 50)
            out["ticks"].append({"shape": list(r["actions"].shape), "dtype": str(r["actions"].dtype),
                                 "step": r["valid_from_step"], "stale": bool(r["stale"])})
        out["reset"] = policy.reset()["episode"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
