"""The front ends: `streamserve serve` (HTTP + WebSocket on one port) and its wire protocols.
Imports the engine, never the other way round; the protocol module has no I/O and no torch."""
