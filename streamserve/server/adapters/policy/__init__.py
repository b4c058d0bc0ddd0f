"""The robot policy endpoint (openpi-compatible): `WS /v1/policy`, and `/` on --policy-port.

    wire.py         openpi's msgpack-NumPy encoding, decoded safely (I/O-free)
    observation.py  an observation checked against the codec, and streamserve's extensions (I/O-free)
    episode.py      one episode on one persistent session of the session service
    connection.py   the protocol adapter: metadata first, latest observation wins, deadlines, stale replies
    endpoint.py     the route, the second site, the served checkpoint's codec
"""

from streamserve.server.adapters.policy.endpoint import PATH, PolicyEndpoint

__all__ = ["PATH", "PolicyEndpoint"]
