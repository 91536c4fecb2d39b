"""``python -m bagpipe.embedding_server.drain --shard K``: move shard K's rows to the other servers and
wait until they serve without it; exits 0 then (the server may stop), 1 on timeout or failure.

The chart runs it as the embedding servers' preStop hook, so ``kubectl scale`` down loses no row. Once the
job is done (the controller scales the servers to zero), nothing is moved."""

from __future__ import annotations

import argparse
import logging
import sys

from bagpipe.config_args import add_coordination_args, positive_float
from bagpipe.control.generation import DONE, current
from bagpipe.control.registry import Registry
from bagpipe.embedding_server.resharder import ReshardFailed, drain


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bagpipe-drain", description=__doc__)
    p.add_argument("--shard", type=int, required=True, help="the embedding server to drain")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="seconds to wait (default 600)")
    add_coordination_args(p)
    a, _ = p.parse_known_args(argv)  # the hook passes the server's own flags; the rest are not ours
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    registry = Registry(a.redis, a.job)
    generation = current(registry)
    if generation is not None and generation.state == DONE:  # the controller releases a finished job
        print(f"drain: the job is done (the model is saved): shard {a.shard} stops without moving rows")
        registry.close()
        return
    try:
        record = drain(registry, a.shard, a.timeout)
    except (TimeoutError, ReshardFailed) as e:
        print(f"drain: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        registry.close()
    if record:
        print(
            f"drain: shard {a.shard} is empty: version {record['to_version']}, "
            f"{record.get('rows_moved', 0)} rows moved in {record.get('seconds', 0.0):.1f} s"
        )
    else:
        print(f"drain: shard {a.shard} held no rows")


if __name__ == "__main__":
    main(sys.argv[1:])
