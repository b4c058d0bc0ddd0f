"""A persistent session, chunk by chunk: append text in pieces, generate, append more, generate again.

    python examples/continue_text.py [--model default|PATH]
"""

from __future__ import annotations

import argparse

from streamserve import Engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    args = p.parse_args()
    engine = Engine.from_pretrained(args.model, device="auto")
    with engine.open_session() as s:
        for chunk in ("In the beginning", " God created", " the heaven"):  # like 200 ms chunks of a stream
            n = s.append(text=chunk)
            print(f"appended {n} tokens: {chunk!r}")
        reply = s.generate(max_tokens=24)
        print("reply:", engine.tokenizer.decode(reply))
        s.append(text="\nAnd the LORD said unto Moses,")
        print("reply:", engine.tokenizer.decode(s.generate(max_tokens=24, temperature=0.8, top_p=0.9, seed=1)))
        print({k: v for k, v in engine.stats().items() if k in ("sessions_open", "kv_bytes", "decode_tokens_per_s")})


if __name__ == "__main__":
    main()
