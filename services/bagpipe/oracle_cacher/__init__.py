"""The oracle-cacher service: lookahead planning and plan dispatch to the trainers."""
