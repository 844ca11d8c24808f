"""`mbd-rs` command line."""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    from . import Engine, MbdError

    ap = argparse.ArgumentParser(prog="mbd-rs", description="Block-diffusion LLM inference engine")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_info = sub.add_parser("info", help="describe a model directory and whether it is supported")
    p_info.add_argument("model")
    p_info.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if args.cmd == "info":
        try:
            eng = Engine.load(args.model, device=args.device)
        except (MbdError, FileNotFoundError) as e:
            print(f"mbd-rs: not supported: {e}", file=sys.stderr)
            return 2
        print(json.dumps(eng.info.__dict__, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
