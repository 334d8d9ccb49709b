"""Entry point of the trainer pods: `python -m rft_trainer --config PATH`."""

import argparse
import sys

EX_CONFIG = 78  # the operator's default fatal exit code: a restart cannot fix this


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rft_trainer")
    ap.add_argument("--config", required=True, help="resolved config JSON from the operator")
    ap.parse_args(argv)
    print("rft_trainer: the FSDP trainer is not implemented yet in this build", file=sys.stderr)
    return EX_CONFIG


if __name__ == "__main__":
    sys.exit(main())
