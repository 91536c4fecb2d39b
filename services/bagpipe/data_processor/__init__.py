"""The data-processor service: a data source turned into numbered global batches."""
