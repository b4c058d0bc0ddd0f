"""Run by test_policy_openpi.py with openpi-client's own virtual environment (`make openpi-venv`: its pins need
numpy<2): the real, unchanged `openpi_client.WebsocketClientPolicy` drives a streamserve server through several
ticks, through openpi's ActionChunkBroker, then sends an observation the server refuses. Prints one JSON line."""

from __future__ import annotations

import json
import sys

import numpy as np
from openpi_client import action_chunk_broker, websocket_client_policy


def main() -> None:
    host, port, key = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None
    policy = websocket_client_policy.WebsocketClientPolicy(host, port, api_key=key)
    meta = policy.get_server_metadata()
    horizon = meta["action_horizon"]
    out: dict = {"metadata": {k: v for k, v in meta.items() if k != "streamserve"}, "ticks": []}
    for i in range(5):
        state = np.array([0.1 * i, -0.1 * i, 0.5], np.float32)
        r = policy.infer({"observation/state": state, "prompt": "reach", "observation/image": np.zeros((8, 8, 3),
                                                                                                      np.uint8)})
        out["ticks"].append({"shape": list(r["actions"].shape), "dtype": str(r["actions"].dtype),
                             "timing": sorted(r["server_timing"]), "stale": r["stale"],
                             "policy_timing": r["policy_timing"],
                             "actions": r["actions"].tolist()})
    broker = action_chunk_broker.ActionChunkBroker(policy, horizon)
    out["broker"] = [list(broker.infer({"observation/state": np.zeros(3, np.float64)})["actions"].shape)
                     for _ in range(horizon + 1)]
    try:
        policy.infer({"observation/state": np.array([np.nan, 0.0, 0.0], np.float32)})
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
