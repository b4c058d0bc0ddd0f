"""llama.cpp's batch-1 greedy decode on a GGUF file, the peer that benchmarks/cpu_decode.py drives.

    build/llamacpp-venv/bin/python benchmarks/llamacpp_peer.py --model FILE.gguf --threads 2 --new 64 \\
        --prompt-ids 1,2,3

It runs in the virtual environment of `make llamacpp-venv` (llama-cpp-python built from source there; no torch,
no streamserve: only llama_cpp and numpy are imported). It loads the file once and prints one JSON line
{"ready": ...}; then for each line read on stdin it runs one rep and prints one JSON line {"tok_s", "tokens"};
at the end of stdin it exits. Driven this way, cpu_decode.py interleaves its reps with the engine's and
transformers', so that all of them see the same load on the machine.

One rep: the prompt's ids evaluated into an empty context, then --new greedy tokens, each one `eval` of the
previous token (one forward) and an argmax over the last position's logits; tok/s = tokens / the time of those
forwards (the prompt is not timed), the same count cpu_decode.py uses for transformers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import llama_cpp
import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the GGUF file")
    p.add_argument("--threads", type=int, required=True, help="threads for decode and for the prompt")
    p.add_argument("--new", type=int, required=True, help="greedy tokens timed per rep")
    p.add_argument("--prompt-ids", required=True, help="the prompt's token ids, comma-separated")
    args = p.parse_args()
    prompt = [int(i) for i in args.prompt_ids.split(",")]
    n_ctx = 64 * -(-(len(prompt) + args.new + 1) // 64)  # small: the prompt and the reply, in steps of 64
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=n_ctx, n_batch=max(len(prompt), 8), n_threads=args.threads,
                          n_threads_batch=args.threads, logits_all=False, verbose=False)
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        """The logits of the last evaluated position, [n_vocab] fp32 (a view of llama.cpp's buffer)."""
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

    print(json.dumps({"ready": True, "llama_cpp_python": llama_cpp.__version__, "n_ctx": n_ctx,
                      "threads": args.threads, "system_info": llama_cpp.llama_print_system_info().decode()}),
          flush=True)
    for _ in sys.stdin:
        llm.reset()  # n_tokens = 0: the next eval drops the previous rep's KV entries
        llm.eval(prompt)
        tokens = [int(last_logits().argmax())]
        t0 = time.perf_counter()
        for _ in range(args.new):
            llm.eval(tokens[-1:])
            tokens.append(int(last_logits().argmax()))
        dt = time.perf_counter() - t0
        print(json.dumps({"tok_s": args.new / dt, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
