"""``python -m bagpipe.trainer``: train until the oracle's last plan, then exit."""

from __future__ import annotations

import logging
import sys

from bagpipe import serving
from bagpipe.trainer.config import parse
from bagpipe.trainer.worker import Trainer

logger = logging.getLogger("bagpipe.trainer")


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse(argv)
    serving.configure_logging(args.log_level)
    trainer = Trainer(cfg)
    try:
        stats = trainer.run()
        logger.info("rank %d done: %d iterations, %.1f samples/s", cfg.rank, stats["iterations"], stats["samples_per_second"])
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
