"""The input layouts shipped with bagpipe (``core/schema.py``): Criteo's and Avazu's."""
