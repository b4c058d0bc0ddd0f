"""`streamserve bench`: a load generator that drives a running `streamserve serve` and prints a JSON report.

    config.py   the frozen BenchConfig (the command's flags are generated from it) and the loopback check
    record.py   one session's figures (latencies, missed deadlines, errors by code) and percentiles
    text.py     native text sessions through the client SDK: real-time appends and short replies
    voice.py    /v1/realtime voice turns with speech synthesised by the Piper voice, in 20 ms frames
    policy.py   robot policy loops at --policy-hz (50 Hz) on /v1/policy (the simulated arm of streamserve.robot.arm)
    server.py   the server's figures sampled every second: KV pages, shed chunks (stats), RSS (/proc)
    run.py      the sessions at once, the progress bar, the report

Everything but config.py imports the client SDK (streamserve-client, a separate distribution), so the CLI imports
only config.py until the command runs (streamserve/cli/bench.py).
"""
