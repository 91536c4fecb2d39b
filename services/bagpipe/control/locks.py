"""The names of the job's Redis locks (``Registry.lock``), shared by whoever takes and whoever breaks them."""

# held by whoever changes the shard map in force (the re-sharding coordinator) or needs it fixed (a
# trainer's checkpoint)
RESHARD_LOCK = "reshard"
# how a trainer's checkpoint names itself holding RESHARD_LOCK (the controller breaks a dead one's hold)
CHECKPOINT_LOCK_OWNER = "checkpoint-"
